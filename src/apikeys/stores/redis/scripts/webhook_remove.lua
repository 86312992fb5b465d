-- KEYS[1] = the endpoints index; ARGV[1] = the webhook keys' prefix, ARGV[2] = the id.
-- Removes the endpoint and its deliveries. Returns 1, or 0 when there was none.
local p, id = ARGV[1], ARGV[2]
if redis.call('ZREM', KEYS[1], id) == 0 then
  return 0
end
redis.call('DEL', p .. 'endpoint:' .. id)
for _, delivery in ipairs(redis.call('SMEMBERS', p .. 'of:' .. id)) do
  local hash = p .. 'delivery:' .. delivery
  local fields = redis.call('HMGET', hash, 'key_id', 'status', 'workspace')
  if fields[1] then
    redis.call('DEL', p .. 'line:' .. id .. ':' .. fields[1])
    redis.call('ZREM', p .. 'status:' .. fields[2], delivery)
  end
  if fields[3] then
    redis.call('ZREM', p .. 'ws:' .. fields[3], delivery)
  end
  redis.call('ZREM', p .. 'due', delivery)
  redis.call('ZREM', p .. 'deliveries', delivery)
  redis.call('ZREM', p .. 'finished', delivery)
  redis.call('DEL', hash, p .. 'lease:' .. delivery)
end
redis.call('DEL', p .. 'of:' .. id)
redis.call('SREM', p .. 'expiring-endpoints', id)
return 1
