-- KEYS[1] = the index of keys with events to take; ARGV = (id, score) pairs as read before
-- their outboxes were taken. Drops each id whose score is unchanged (no change since).
for i = 1, #ARGV, 2 do
  local score = redis.call('ZSCORE', KEYS[1], ARGV[i])
  if score and tonumber(score) == tonumber(ARGV[i + 1]) then
    redis.call('ZREM', KEYS[1], ARGV[i])
  end
end
return 1
