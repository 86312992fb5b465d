-- KEYS[1] = the endpoints index; ARGV[1] = the webhook keys' prefix, ARGV[2] = the listing
-- index (`deliveries`, `status:<status>` or `ws:<workspace>`), ARGV[3] = how many, ARGV[4]
-- and ARGV[5] = the score and the id of the position to start after (none: the newest).
-- Returns up to that many (id, score) pairs of the index after the position, newest first:
-- by score, then id, both descending, as ZREVRANGE reads it.
-- The delivery at the position may have left the index since (delivered, pruned), so the
-- page starts at its rank counted, not looked up: every id of a higher score, and those of
-- its score (ordered by id within it) from the position's id up, found by bisection.
local index, count = ARGV[1] .. ARGV[2], tonumber(ARGV[3])
local first = 0
if ARGV[4] then
  local score, id = ARGV[4], ARGV[5]
  first = redis.call('ZCOUNT', index, '(' .. score, '+inf')
  local low, high = 0, redis.call('ZCOUNT', index, score, score)
  while low < high do
    local middle = math.floor((low + high) / 2)
    if redis.call('ZREVRANGE', index, first + middle, first + middle)[1] >= id then
      low = middle + 1
    else
      high = middle
    end
  end
  first = first + low
end
return redis.call('ZREVRANGE', index, first, first + count - 1, 'WITHSCORES')
