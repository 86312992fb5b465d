-- KEYS[1] = the hash of a key (or an identity), KEYS[2] = a key's use hash (none for an
-- identity). Returns the hash's fields (as HGETALL), its TTL in milliseconds (as PTTL: -1
-- for none, -2 for no hash) and the use hash's fields, read together.
local used = {}
if KEYS[2] then
  used = redis.call('HGETALL', KEYS[2])
end
return {redis.call('HGETALL', KEYS[1]), redis.call('PTTL', KEYS[1]), used}
