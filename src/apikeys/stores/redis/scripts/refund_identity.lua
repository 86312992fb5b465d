-- Give back ARGV[1] credits to an identity (KEYS[1]) that a Cluster's split spend took for
-- a request its key then refused, unless its credits were refilled (ARGV[2], the
-- `credits_refilled_at` seen when they were taken; '' for none) or cleared since.
local fields = redis.call('HMGET', KEYS[1], 'credits', 'credits_refilled_at')
if fields[1] and (fields[2] or '') == ARGV[2] then
  return redis.call('HINCRBY', KEYS[1], 'credits', tonumber(ARGV[1]))
end
return -1
