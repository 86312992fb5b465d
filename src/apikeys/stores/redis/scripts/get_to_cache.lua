-- KEYS[1] = the key's hash. Returns its fields (as HGETALL) and its TTL in milliseconds (as
-- PTTL: -1 for none, -2 for no hash), read together.
return {redis.call('HGETALL', KEYS[1]), redis.call('PTTL', KEYS[1])}
