-- KEYS[1] = the endpoints index; ARGV[1] = the webhook keys' prefix, ARGV[2] = now
-- (microseconds). Erases the previous secret of each endpoint whose overlap ended by now.
-- Returns the number erased.
local erased = 0
for _, id in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  local hash = ARGV[1] .. 'endpoint:' .. id
  local f = redis.call('HMGET', hash, 'previous_secret', 'previous_until')
  if f[1] and ((not f[2]) or tonumber(f[2]) <= tonumber(ARGV[2])) then
    redis.call('HDEL', hash, 'previous_secret', 'previous_until')
    erased = erased + 1
  end
end
return erased
