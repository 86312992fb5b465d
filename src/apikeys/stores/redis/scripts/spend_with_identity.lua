-- An identity's credits and a key's, taken together or not at all.
-- KEYS[1] = the identity's hash, KEYS[2] = the key's hash (unread when ARGV[7] is not '1').
-- ARGV[1] = cost; ARGV[2], ARGV[3] = the identity's refill amount ('' for none) and its
-- period's start (microseconds); ARGV[4], ARGV[5] = the key's; ARGV[6] = '1' when KEYS[2]
-- is the successor of the key spending (its own state is then not checked); ARGV[7] = '1'
-- when the key is charged (it has credits), else only the identity is.
-- Returns {0, identity left, key left, the identity's credits_refilled_at ('' for none)}
-- (-1: unlimited, not charged) once both are taken;
-- {1} when the identity refuses (too few credits, or it does not exist), {2} when the key
-- does (too few, none, revoked, missing), and then nothing was taken (a refill that came
-- due is kept); or {3, successor id} for a rolled key: the caller asks again with the
-- successor's hash, which holds the pair's balance (nothing was written).
local cost = tonumber(ARGV[1])
local charged_key = ARGV[7] == '1'
local key
if charged_key then
  key = redis.call('HMGET', KEYS[2], 'credits', 'state', 'credits_refilled_at', 'replaced_by')
  if key[2] and key[4] and not (key[2] == 'revoked' and ARGV[6] ~= '1') then
    return {3, key[4]}
  end
end
local identity = redis.call('HMGET', KEYS[1], 'credits', 'credits_refilled_at', 'state')
if not identity[3] then
  return {1}
end
local identity_left = -1
local refilled_at = identity[2] or ''
if identity[1] then
  identity_left = tonumber(identity[1])
  if ARGV[2] ~= '' and ((not identity[2]) or tonumber(identity[2]) < tonumber(ARGV[3])) then
    identity_left = tonumber(ARGV[2])
    refilled_at = ARGV[3]
    redis.call('HSET', KEYS[1], 'credits', identity_left, 'credits_refilled_at', ARGV[3])
  end
  if identity_left < cost then
    return {1}
  end
end
local key_left = -1
if charged_key then
  if (not key[2]) or (key[2] == 'revoked' and ARGV[6] ~= '1') or not key[1] then
    return {2}
  end
  key_left = tonumber(key[1])
  if ARGV[4] ~= '' and ((not key[3]) or tonumber(key[3]) < tonumber(ARGV[5])) then
    key_left = tonumber(ARGV[4])
    redis.call('HSET', KEYS[2], 'credits', key_left, 'credits_refilled_at', ARGV[5])
  end
  if key_left < cost then
    return {2}
  end
  key_left = key_left - cost
  redis.call('HSET', KEYS[2], 'credits', key_left)
end
if identity_left >= 0 then
  identity_left = identity_left - cost
  redis.call('HSET', KEYS[1], 'credits', identity_left)
end
return {0, identity_left, key_left, refilled_at}
