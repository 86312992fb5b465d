-- KEYS[1] = the endpoints index; ARGV[1] = the webhook keys' prefix, ARGV[2] = the
-- delivery, ARGV[3] = now (microseconds). Makes it pending from now, in its place in its
-- line. Returns 1, 0 when there is no such delivery, or -1, changing nothing, while a
-- process holds its lease (it is being sent: its holder records the attempt).
local p, id = ARGV[1], ARGV[2]
local hash = p .. 'delivery:' .. id
local f = redis.call('HMGET', hash, 'webhook_id', 'key_id', 'order', 'status')
if not f[1] then
  return 0
end
if redis.call('EXISTS', p .. 'lease:' .. id) == 1 then
  return -1
end
redis.call('HSET', hash, 'status', 'pending', 'created_at', ARGV[3], 'next_attempt_at', ARGV[3])
redis.call('ZREM', p .. 'status:' .. f[4], id)
redis.call('ZADD', p .. 'status:pending', f[3], id)
redis.call('ZREM', p .. 'finished', id)
redis.call('ZADD', p .. 'due', ARGV[3], id)
redis.call('ZADD', p .. 'line:' .. f[1] .. ':' .. f[2], f[3], id)
return 1
