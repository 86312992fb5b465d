-- KEYS[1] = the endpoints index; ARGV[1] = the webhook keys' prefix, ARGV[2] = now
-- (microseconds), ARGV[3] = how long before expiry each `key.expiring` notice is, in
-- microseconds, the first one first, comma-separated; then (id, expires_at or '', '1' when
-- the key has a credit refill, else '') triples, for keys as they are now ('' and '' for a
-- revoked or missing key). Keeps the two indexes of keys the minute's look reads:
-- `expiring`, the keys that are usable and expire later, each scored by when it is next
-- looked at (one of its notice times, or its expiry once the notices are made); and
-- `refilled`, the keys with a credit refill, by when each was last looked at. A key whose
-- score fits its expiry keeps it; any other score (a new expiry, or a key not indexed
-- yet) becomes its first notice time, so its notices are looked for from the start.
-- Returns the number of keys whose entries were added or changed.
local p, now = ARGV[1], tonumber(ARGV[2])
local notices = {}
for offset in string.gmatch(ARGV[3], '[^,]+') do
  notices[#notices + 1] = tonumber(offset)
end
local changed = 0
for i = 4, #ARGV, 3 do
  local id, expires, refilled = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  if expires ~= '' and tonumber(expires) > now then
    local at = tonumber(expires)
    local score = tonumber(redis.call('ZSCORE', p .. 'expiring', id))
    local fits = score == at
    for _, offset in ipairs(notices) do
      fits = fits or score == at - offset
    end
    if not fits then
      redis.call('ZADD', p .. 'expiring', at - notices[1], id)
      changed = changed + 1
    end
  elseif redis.call('ZREM', p .. 'expiring', id) == 1 then
    changed = changed + 1
  end
  if refilled ~= '' then
    changed = changed + redis.call('ZADD', p .. 'refilled', 'NX', now, id)
  else
    changed = changed + redis.call('ZREM', p .. 'refilled', id)
  end
end
return changed
