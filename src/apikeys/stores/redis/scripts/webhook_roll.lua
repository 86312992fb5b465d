-- KEYS[1] = the endpoints index; ARGV[1] = the webhook keys' prefix, ARGV[2] = the id,
-- ARGV[3] = the new secret, ARGV[4] = until when the current one signs too (microseconds).
-- Returns 1 when rolled, 0 when there is no such endpoint.
local hash = ARGV[1] .. 'endpoint:' .. ARGV[2]
local current = redis.call('HGET', hash, 'secret')
if not current then
  return 0
end
redis.call('HSET', hash, 'previous_secret', current, 'previous_until', ARGV[4], 'secret', ARGV[3])
return 1
