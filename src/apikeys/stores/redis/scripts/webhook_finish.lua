-- KEYS[1] = the endpoints index; ARGV[1] = the webhook keys' prefix, ARGV[2] = the
-- delivery, ARGV[3] = the holder, ARGV[4] = the status, ARGV[5] = now, ARGV[6] = the next
-- attempt (microseconds), ARGV[7] = the response ('' for none), ARGV[8] = the error ('' for
-- none). Records an attempt of a delivery whose lease the holder holds; returns 1, else 0.
-- A delivery delivered or failed goes into `finished`, by the time of its last attempt
-- (what pruning reads).
local p, id, status = ARGV[1], ARGV[2], ARGV[4]
local lease = p .. 'lease:' .. id
if redis.call('GET', lease) ~= ARGV[3] then
  return 0
end
local hash = p .. 'delivery:' .. id
local f = redis.call('HMGET', hash, 'webhook_id', 'key_id', 'order', 'status')
if not f[1] then
  return 0
end
redis.call('HINCRBY', hash, 'attempts', 1)
redis.call('HSET', hash, 'status', status, 'last_attempt_at', ARGV[5], 'next_attempt_at', ARGV[6])
if ARGV[7] == '' then redis.call('HDEL', hash, 'last_status') else redis.call('HSET', hash, 'last_status', ARGV[7]) end
if ARGV[8] == '' then redis.call('HDEL', hash, 'last_error') else redis.call('HSET', hash, 'last_error', ARGV[8]) end
if status == 'pending' then
  redis.call('ZADD', p .. 'due', ARGV[6], id)
else
  local line = p .. 'line:' .. f[1] .. ':' .. f[2]
  redis.call('ZREM', p .. 'due', id)
  redis.call('ZREM', line, id)
  -- The line's next delivery is first now: due again (a claim took it out of `due`).
  local next = redis.call('ZRANGE', line, 0, 0)[1]
  if next then
    local at = redis.call('HGET', p .. 'delivery:' .. next, 'next_attempt_at')
    if at then
      redis.call('ZADD', p .. 'due', at, next)
    end
  end
  redis.call('ZREM', p .. 'status:' .. f[4], id)
  redis.call('ZADD', p .. 'status:' .. status, f[3], id)
  redis.call('ZADD', p .. 'finished', ARGV[5], id)
end
redis.call('DEL', lease)
return 1
