-- KEYS[1] = the endpoints index; ARGV[1] = the webhook keys' prefix, ARGV[2] = the id,
-- ARGV[3] = created_at (microseconds), then field, value pairs. The endpoint takes the
-- events stored after the server's time now (`since`).
local now = redis.call('TIME')
local stamp = now[1] .. string.format('%06d', tonumber(now[2]))
local hash = ARGV[1] .. 'endpoint:' .. ARGV[2]
redis.call('HSET', hash, 'since', stamp, unpack(ARGV, 4))
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[2])
return stamp
