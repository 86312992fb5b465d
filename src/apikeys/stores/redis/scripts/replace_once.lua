-- KEYS[1] = a one-time value; ARGV[1] = the value it must hold; ARGV[2] = its new value and
-- ARGV[3] = the new value's TTL in milliseconds, or neither: remove it. Returns 1 if
-- replaced, 0 if KEYS[1] held another value or none (an expired value is none).
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 0
end
if #ARGV < 3 then
  redis.call('DEL', KEYS[1])
else
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
end
return 1
