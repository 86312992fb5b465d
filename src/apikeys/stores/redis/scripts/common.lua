-- Prepended to every change script. Each one ends its ARGV with the same three values: the
-- audit event, the notice channel and the notice ('' for none), and has the key's audit
-- list as KEYS[2], in the key's own slot. The event is appended only when the change
-- happened, and the notice published, in the script itself: no change commits without its
-- event and its notice.
local function publish()
  if ARGV[#ARGV] ~= '' then
    redis.call('PUBLISH', ARGV[#ARGV - 1], ARGV[#ARGV])
  end
end
local function record()
  if ARGV[#ARGV - 2] ~= '' then
    redis.call('RPUSH', KEYS[2], ARGV[#ARGV - 2])
  end
end
