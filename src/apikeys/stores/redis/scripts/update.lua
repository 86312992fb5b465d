-- KEYS[1] = the key's hash, KEYS[2] = its audit list; ARGV[1] = how many fields to set,
-- then field, value pairs to set, then fields to delete, then the common tail. Changes a
-- key that exists and whose state `EDITABLE` holds (not revoked); publishes the notice (also when nothing changed).
-- Returns the hash and the use hash afterwards (`hashes_now()`), or nil when the key does
-- not exist.
local state = redis.call('HGET', KEYS[1], 'state')
if not state then
  return false
end
if EDITABLE[state] then
  local sets = tonumber(ARGV[1])
  for i = 2, 1 + 2 * sets, 2 do
    redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
  end
  for i = 2 + 2 * sets, #ARGV - 4 do
    redis.call('HDEL', KEYS[1], ARGV[i])
  end
  record()
end
publish()
return hashes_now()
