-- KEYS[1] = the endpoints index; ARGV[1] = the webhook keys' prefix, ARGV[2] = the index
-- (`expiring` or `refilled`), then (id, score as read, new score or '' to drop it)
-- triples. Moves each id whose score is still the one read: an id a change re-scored
-- meanwhile (`webhook_watch`) keeps the new score. Returns the number moved.
local index = ARGV[1] .. ARGV[2]
local moved = 0
for i = 3, #ARGV, 3 do
  local score = redis.call('ZSCORE', index, ARGV[i])
  if score and tonumber(score) == tonumber(ARGV[i + 1]) then
    if ARGV[i + 2] == '' then
      redis.call('ZREM', index, ARGV[i])
    else
      redis.call('ZADD', index, ARGV[i + 2], ARGV[i])
    end
    moved = moved + 1
  end
end
return moved
