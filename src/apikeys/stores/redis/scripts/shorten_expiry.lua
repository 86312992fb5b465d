-- KEYS[1] = the key's hash, KEYS[2] = its audit list; ARGV[1] = expires_at (microseconds),
-- ARGV[2] = replaced_by ('' to leave it), then the common tail. Changes a key that exists
-- and whose state `EDITABLE` holds (not revoked), and with a replaced_by only one that no other key replaces already
-- (two rolls at once: one wins); publishes the notice (also when nothing changed).
-- Returns the hash and the use hash afterwards (`hashes_now()`), or nil when the key does
-- not exist.
local state = redis.call('HGET', KEYS[1], 'state')
if not state then
  return false
end
local editable = EDITABLE[state]
local taken = redis.call('HGET', KEYS[1], 'replaced_by')
if ARGV[2] ~= '' and taken and taken ~= '' and taken ~= ARGV[2] then
  editable = false -- replaced by another roll already: change nothing
end
if editable then
  local changed = false
  local current = redis.call('HGET', KEYS[1], 'expires_at')
  if (not current) or tonumber(ARGV[1]) < tonumber(current) then
    redis.call('HSET', KEYS[1], 'expires_at', ARGV[1])
    changed = true
  end
  if ARGV[2] ~= '' then
    redis.call('HSET', KEYS[1], 'replaced_by', ARGV[2])
    changed = true
  end
  if changed then
    record()
  end
end
publish()
return hashes_now()
