-- KEYS[1] = the key's hash, KEYS[2..] as in common.lua; ARGV = field, value, field, value,
-- ..., then the common tail.
-- Returns 1 when created, 0 when the id is taken.
if redis.call('EXISTS', KEYS[1]) == 1 then
  return 0
end
redis.call('HSET', KEYS[1], unpack(ARGV, 1, #ARGV - 4))
record()
return 1
