-- KEYS[1] = the key's hash, KEYS[2] = the batch's marker, KEYS[3] = the key's use hash,
-- KEYS[4..] = its daily usage hashes (one per day in the batch). The counts go to the use
-- hash, never to the key's hash: a write there is a change every key cache drops the key for. ARGV[1] = count, ARGV[2] = last_used_at
-- (microseconds), ARGV[3] = this send's nonce, ARGV[4] = the marker's TTL in seconds,
-- ARGV[5] = the daily hashes' TTL in seconds, then (key index, outcome, count) triples
-- naming the daily hashes.
-- Returns 1 if applied, 0 for an unknown id (nothing is created) or a batch applied before.
local marker = redis.call('GET', KEYS[2])
if not marker then
  redis.call('SET', KEYS[2], ARGV[3], 'EX', ARGV[4])
elseif marker ~= ARGV[3] then
  return 0
end
if redis.call('EXISTS', KEYS[1]) == 0 then
  return 0
end
if tonumber(ARGV[1]) ~= 0 then
  redis.call('HINCRBY', KEYS[3], 'request_count', ARGV[1])
  local current = redis.call('HGET', KEYS[3], 'last_used_at')
  if (not current) or tonumber(ARGV[2]) > tonumber(current) then
    redis.call('HSET', KEYS[3], 'last_used_at', ARGV[2])
  end
  -- A key's hash given a TTL by hand: its counts go with it.
  local ttl = redis.call('PTTL', KEYS[1])
  if ttl > 0 then
    redis.call('PEXPIRE', KEYS[3], ttl)
  end
end
for i = 6, #ARGV, 3 do
  local day = KEYS[tonumber(ARGV[i])]
  redis.call('HINCRBY', day, ARGV[i + 1], ARGV[i + 2])
  redis.call('EXPIRE', day, ARGV[5])
end
return 1
