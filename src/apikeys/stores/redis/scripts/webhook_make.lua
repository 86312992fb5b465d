-- KEYS[1] = the endpoints index; ARGV[1] = the webhook keys' prefix, ARGV[2] = created_at
-- (microseconds), then (id, endpoint, key id, event, body, order, workspace) septuples.
-- Makes each delivery unless it exists (ids are derived from what they deliver: made twice,
-- it is stored once) or its endpoint is gone. Returns the number made.
local p, now = ARGV[1], ARGV[2]
local made = 0
for i = 3, #ARGV, 7 do
  local id, endpoint, key, order, workspace = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 5], ARGV[i + 6]
  local hash = p .. 'delivery:' .. id
  if redis.call('ZSCORE', KEYS[1], endpoint) and redis.call('EXISTS', hash) == 0 then
    redis.call('HSET', hash, 'webhook_id', endpoint, 'key_id', key, 'event', ARGV[i + 3],
      'body', ARGV[i + 4], 'status', 'pending', 'attempts', 0, 'created_at', now,
      'next_attempt_at', now, 'order', order, 'workspace', workspace)
    redis.call('ZADD', p .. 'due', now, id)
    redis.call('ZADD', p .. 'deliveries', order, id)
    redis.call('ZADD', p .. 'status:pending', order, id)
    redis.call('ZADD', p .. 'ws:' .. workspace, order, id)
    redis.call('ZADD', p .. 'line:' .. endpoint .. ':' .. key, order, id)
    redis.call('SADD', p .. 'of:' .. endpoint, id)
    made = made + 1
  end
end
return made
