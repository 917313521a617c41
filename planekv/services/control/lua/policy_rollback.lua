-- Undo a policy's last activation.
-- KEYS: policy hash, versions, activation stack, history, channel; ARGV: name, now, expected version
-- (the one the caller checked; '' or absent = any)
-- Returns the version active again, -1 = no such policy, -2 = no earlier activation, -3 = the version to
-- roll back to is not the expected one (another activation ran since the caller checked).
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
if redis.call('LLEN', KEYS[3]) < 2 then return -2 end
if ARGV[3] and ARGV[3] ~= '' and redis.call('LINDEX', KEYS[3], -2) ~= ARGV[3] then return -3 end
local cur = redis.call('RPOP', KEYS[3])
local prev = redis.call('LINDEX', KEYS[3], -1)
redis.call('HSET', KEYS[1], 'active', prev)
redis.call('RPUSH', KEYS[4],
  '{"action":"rolled_back","version":' .. prev .. ',"previous":' .. cur .. ',"at":' .. ARGV[2] .. '}')
redis.call('PUBLISH', KEYS[5], ARGV[1] .. ':' .. prev)
return tonumber(prev)
