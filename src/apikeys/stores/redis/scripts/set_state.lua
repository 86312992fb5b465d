-- KEYS[1] = the key's hash, KEYS[2] = its audit list; ARGV[1] = new state, ARGV[2] = `at`
-- (microseconds), ARGV[3..] = allowed states, then the common tail.
-- Returns the hash and the use hash afterwards (`hashes_now()`), or nil when the key does
-- not exist.
local current = redis.call('HGET', KEYS[1], 'state')
if not current then
  return false
end
if current ~= ARGV[1] then
  for i = 3, #ARGV - 4 do
    if ARGV[i] == current then
      if ARGV[1] == 'revoked' then
        redis.call('HSET', KEYS[1], 'state', ARGV[1], 'revoked_at', ARGV[2])
      else
        redis.call('HSET', KEYS[1], 'state', ARGV[1])
      end
      record()
      break
    end
  end
end
publish()
return hashes_now()
