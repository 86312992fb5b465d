-- KEYS[1] = the key's hash; ARGV[1] = cost, ARGV[2] = refill amount ('' for none),
-- ARGV[3] = the refill period's start (microseconds). Returns the credits left, or -1 when
-- too few (nothing taken), the key has none (unlimited), is revoked or does not exist.
local fields = redis.call('HMGET', KEYS[1], 'credits', 'state', 'credits_refilled_at')
local left = fields[1]
if (not left) or fields[2] == 'revoked' then
  return -1
end
left = tonumber(left)
if ARGV[2] ~= '' and ((not fields[3]) or tonumber(fields[3]) < tonumber(ARGV[3])) then
  left = tonumber(ARGV[2])
  redis.call('HSET', KEYS[1], 'credits', left, 'credits_refilled_at', ARGV[3])
end
local cost = tonumber(ARGV[1])
if left < cost then
  return -1
end
redis.call('HSET', KEYS[1], 'credits', left - cost)
return left - cost
