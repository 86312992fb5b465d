-- KEYS[1] = the endpoints index; ARGV[1] = the webhook keys' prefix, ARGV[2] = before
-- (microseconds), ARGV[3] = how many at most. Deletes the deliveries delivered or failed
-- before then (`finished`, by their last attempt: a replay takes a delivery out of it),
-- with every index entry of theirs. Returns the number deleted.
local p = ARGV[1]
local old = redis.call('ZRANGEBYSCORE', p .. 'finished', '-inf', '(' .. ARGV[2], 'LIMIT', 0, tonumber(ARGV[3]))
local deleted = 0
for _, id in ipairs(old) do
  local hash = p .. 'delivery:' .. id
  local f = redis.call('HMGET', hash, 'webhook_id', 'key_id', 'status', 'workspace')
  redis.call('ZREM', p .. 'finished', id)
  if f[3] ~= 'pending' then
    if f[1] then
      redis.call('SREM', p .. 'of:' .. f[1], id)
      redis.call('ZREM', p .. 'line:' .. f[1] .. ':' .. f[2], id)
      redis.call('ZREM', p .. 'status:' .. f[3], id)
    end
    if f[4] then
      redis.call('ZREM', p .. 'ws:' .. f[4], id)
    end
    redis.call('ZREM', p .. 'due', id)
    redis.call('ZREM', p .. 'deliveries', id)
    redis.call('DEL', hash, p .. 'lease:' .. id)
    deleted = deleted + 1
  end
end
return deleted
