-- KEYS[1] = the setting; ARGV[1] = the value to record, ARGV[2..] = values it may replace.
-- Returns the value recorded afterwards.
local recorded = redis.call('GET', KEYS[1])
local replace = not recorded
for i = 2, #ARGV do
  if recorded == ARGV[i] then replace = true end
end
if replace then
  redis.call('SET', KEYS[1], ARGV[1])
  return ARGV[1]
end
return recorded
