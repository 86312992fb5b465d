-- Prepended to every change script. Each one ends its ARGV with the same four values: the
-- webhook event ('' for none), the audit event, the notice channel and the notice ('' for
-- none), and has as KEYS[2] the key's audit list, as KEYS[3] its webhook outbox, as KEYS[4]
-- its use hash (an identity, which has none, names its own hash again), all in the key's
-- own slot, and as KEYS[5] (not on a cluster) the index of keys with events to take.
-- The event is appended only when the change happened, and the notice published, in the
-- script itself: no change commits without its event and its notice.
local function publish()
  if ARGV[#ARGV] ~= '' then
    redis.call('PUBLISH', ARGV[#ARGV - 1], ARGV[#ARGV])
  end
end
-- The record as it is now: its hash and its use hash (flat HGETALLs; no use hash, empty).
local function hashes_now()
  if KEYS[4] == KEYS[1] then
    return {redis.call('HGETALL', KEYS[1]), {}}
  end
  return {redis.call('HGETALL', KEYS[1]), redis.call('HGETALL', KEYS[4])}
end
-- Each event is stored after the server's time in microseconds and a space: events of
-- different keys live in different lists, and this puts them back in the order they were
-- committed (the events of one change, such as a roll, share their own `time`).
-- The webhook event goes to the key's outbox with that time and the key's fields as they
-- are now, without its hash, then its use hash's (empty for an identity); the outbox lives
-- a week after its last event. An identity's change scripts run on its hash with its own
-- audit list and outbox (`events:{i:<id>}`).
local function record()
  if ARGV[#ARGV - 2] ~= '' then
    local now = redis.call('TIME')
    local stamp = now[1] .. string.format('%06d', tonumber(now[2]))
    redis.call('RPUSH', KEYS[2], stamp .. ' ' .. ARGV[#ARGV - 2])
    if ARGV[#ARGV - 3] ~= '' and KEYS[3] then
      local hashes = hashes_now()
      local entry = {stamp, ARGV[#ARGV - 3]}
      for n = 1, 2 do
        local fields, map = hashes[n], {}
        for i = 1, #fields, 2 do
          if fields[i] ~= 'secret_hash' then
            map[fields[i]] = fields[i + 1]
          end
        end
        entry[n + 2] = map
      end
      redis.call('RPUSH', KEYS[3], cjson.encode(entry))
      redis.call('EXPIRE', KEYS[3], 604800)
      if KEYS[5] then
        -- The outbox's hash tag: a key's id, or `i:<id>` for an identity's outbox.
        redis.call('ZINCRBY', KEYS[5], 1, string.match(KEYS[3], '{([^{}]*)}$'))
      end
    end
  end
end
