-- KEYS[1] = the endpoints index; ARGV[1] = the webhook keys' prefix, ARGV[2] = now
-- (microseconds), ARGV[3] = the lease in milliseconds, ARGV[4] = the holder, ARGV[5] = how
-- many, ARGV[6] = how many due entries to read at most. Leases (SET NX PX) the due
-- deliveries that are first in line for their endpoint and key. One that is not is taken
-- out of `due` (finish puts a line's next delivery back when its first one leaves), so
-- the deliveries waiting behind one key's retries never hide other keys' from a claim.
-- Returns (id, endpoint, body, attempts, created_at, order) for each.
local p = ARGV[1]
local wanted = tonumber(ARGV[5])
local claimed = {}
local due = redis.call('ZRANGEBYSCORE', p .. 'due', '-inf', ARGV[2], 'LIMIT', 0, tonumber(ARGV[6]))
for _, id in ipairs(due) do
  if #claimed >= wanted * 6 then
    break
  end
  local hash = p .. 'delivery:' .. id
  local f = redis.call('HMGET', hash, 'webhook_id', 'key_id', 'body', 'attempts', 'created_at', 'order', 'status')
  if (not f[1]) or f[7] ~= 'pending' then
    redis.call('ZREM', p .. 'due', id)
  else
    local first = redis.call('ZRANGE', p .. 'line:' .. f[1] .. ':' .. f[2], 0, 0)[1]
    if first ~= id then
      redis.call('ZREM', p .. 'due', id)
    elseif redis.call('SET', p .. 'lease:' .. id, ARGV[4], 'NX', 'PX', ARGV[3]) then
      for _, value in ipairs({id, f[1], f[3], f[4], f[5], f[6]}) do
        claimed[#claimed + 1] = value
      end
    end
  end
end
return claimed
