-- KEYS[1] = a one-time value. Returns it and deletes it, in one step (GETDEL, before 6.2).
local value = redis.call('GET', KEYS[1])
if value then
  redis.call('DEL', KEYS[1])
end
return value
