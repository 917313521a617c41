-- Make a version of a policy the active one.
-- KEYS: policy hash, versions, activation stack, history, channel; ARGV: name, version, now
-- Returns 1 = activated, 0 = already active, -1 = no such policy, -2 = no such version.
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
local v = tonumber(ARGV[2])
if v > redis.call('LLEN', KEYS[2]) then return -2 end
local cur = redis.call('HGET', KEYS[1], 'active')
if tonumber(cur) == v then return 0 end
redis.call('HSET', KEYS[1], 'active', v)
redis.call('RPUSH', KEYS[3], v)
redis.call('RPUSH', KEYS[4],
  '{"action":"activated","version":' .. v .. ',"previous":' .. cur .. ',"at":' .. ARGV[3] .. '}')
redis.call('PUBLISH', KEYS[5], ARGV[1] .. ':' .. v)
return 1
