-- KEYS[1] = the endpoints index; ARGV[1] = the webhook keys' prefix, ARGV[2] = now
-- (microseconds), ARGV[3] = the lease in milliseconds, ARGV[4] = the holder, ARGV[5] = how
-- many, ARGV[6] = how many due entries to read at most, ARGV[7] = '1' when the claim is
-- bounded per endpoint, then pairs (endpoint id, how many of its deliveries at most).
-- Leases (SET NX PX) the due deliveries that are first in line for their endpoint and key,
-- round robin across endpoints (each endpoint's first due, then each one's second, ...),
-- so one endpoint's backlog never takes another's turn. One that is not first in line is
-- taken out of `due` (finish puts a line's next delivery back when its first one leaves),
-- so the deliveries waiting behind one key's retries never hide other keys' from a claim.
-- Returns (id, endpoint, body, attempts, created_at, order) for each.
local p = ARGV[1]
local wanted = tonumber(ARGV[5])
local room = nil
if ARGV[7] == '1' then
  room = {}
  for i = 8, #ARGV, 2 do
    room[ARGV[i]] = tonumber(ARGV[i + 1])
  end
end
local ranked = {}
local taken = {}
local due = redis.call('ZRANGEBYSCORE', p .. 'due', '-inf', ARGV[2], 'LIMIT', 0, tonumber(ARGV[6]))
for position, id in ipairs(due) do
  local hash = p .. 'delivery:' .. id
  local f = redis.call('HMGET', hash, 'webhook_id', 'key_id', 'body', 'attempts', 'created_at', 'order', 'status')
  if (not f[1]) or f[7] ~= 'pending' then
    redis.call('ZREM', p .. 'due', id)
  else
    local first = redis.call('ZRANGE', p .. 'line:' .. f[1] .. ':' .. f[2], 0, 0)[1]
    if first ~= id then
      redis.call('ZREM', p .. 'due', id)
    elseif redis.call('EXISTS', p .. 'lease:' .. id) == 0 then
      local rank = taken[f[1]] or 0
      if room == nil or rank < (room[f[1]] or 0) then
        taken[f[1]] = rank + 1
        ranked[#ranked + 1] = {rank, position, id, f}
      end
    end
  end
end
table.sort(ranked, function(a, b)
  if a[1] ~= b[1] then
    return a[1] < b[1]
  end
  return a[2] < b[2]
end)
local claimed = {}
for _, entry in ipairs(ranked) do
  if #claimed >= wanted * 6 then
    break
  end
  local id, f = entry[3], entry[4]
  if redis.call('SET', p .. 'lease:' .. id, ARGV[4], 'NX', 'PX', ARGV[3]) then
    for _, value in ipairs({id, f[1], f[3], f[4], f[5], f[6]}) do
      claimed[#claimed + 1] = value
    end
  end
end
return claimed
