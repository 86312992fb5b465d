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
-- Each event is stored after the server's time in microseconds and a space: events of
-- different keys live in different lists, and this puts them back in the order they were
-- committed (the events of one change, such as a roll, share their own `time`).
local function record()
  if ARGV[#ARGV - 2] ~= '' then
    local now = redis.call('TIME')
    local stamp = now[1] .. string.format('%06d', tonumber(now[2]))
    redis.call('RPUSH', KEYS[2], stamp .. ' ' .. ARGV[#ARGV - 2])
  end
end
