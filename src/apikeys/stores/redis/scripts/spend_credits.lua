-- KEYS[1] = the key's hash; ARGV[1] = cost, ARGV[2] = refill amount ('' for none),
-- ARGV[3] = the refill period's start (microseconds), ARGV[4] = '1' when KEYS[1] is the
-- successor of the key spending (its own state is then not checked). Returns the credits
-- left, or -1 when too few (nothing taken), the key has none (unlimited), is revoked or does
-- not exist; or, for a rolled key, the id of its successor, which holds the pair's balance
-- (the caller spends there: the link is set in the same script that reads the old balance,
-- so nothing is taken from a rolled key's own credits).
local fields = redis.call('HMGET', KEYS[1], 'credits', 'state', 'credits_refilled_at', 'replaced_by')
if (not fields[2]) or (fields[2] == 'revoked' and ARGV[4] ~= '1') then
  return -1
end
if fields[4] then
  return fields[4]
end
local left = fields[1]
if not left then
  return -1
end
left = tonumber(left)
if ARGV[2] ~= '' and ((not fields[3]) or tonumber(fields[3]) < tonumber(ARGV[3])) then
  left = tonumber(ARGV[2])
  redis.call('HSET', KEYS[1], 'credits', left, 'credits_refilled_at', ARGV[3])
end
local cost = tonumber(ARGV[1])
if left < cost then
  return -1
end
redis.call('HSET', KEYS[1], 'credits', left - cost)
return left - cost
