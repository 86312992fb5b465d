-- KEYS[1] = the key's hash, KEYS[2..] as in common.lua; ARGV = field, value, field, value,
-- ..., then the common tail.
-- Returns 1 when created, 0 when the id is taken.
if redis.call('EXISTS', KEYS[1]) == 1 then
  return 0
end
redis.call('HSET', KEYS[1], unpack(ARGV, 1, #ARGV - 4))
if KEYS[4] ~= KEYS[1] then
  -- Counts left by a key of this id deleted by hand are not the new key's.
  redis.call('DEL', KEYS[4])
end
record()
return 1
