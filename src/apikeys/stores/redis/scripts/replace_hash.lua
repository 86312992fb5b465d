-- KEYS[1] = the key's hash, KEYS[2] = its audit list; ARGV[1] = old hash, ARGV[2] = new
-- hash, then the common tail. Returns 1 if swapped.
if redis.call('HGET', KEYS[1], 'secret_hash') == ARGV[1] then
  redis.call('HSET', KEYS[1], 'secret_hash', ARGV[2])
  record()
  publish()
  return 1
end
return 0
