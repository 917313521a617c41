-- Add a version to a policy (none if it equals the latest), activating it if ARGV[5] == '1'.
-- KEYS: policy hash, versions, activation stack, history, channel; ARGV: name, version doc, now, sha256, activate
-- Returns {version, 1} = added, {latest, 0} = same as the latest, {-1, 0} = no such policy.
if redis.call('EXISTS', KEYS[1]) == 0 then return {-1, 0} end
local n = redis.call('LLEN', KEYS[2])
if redis.call('HGET', KEYS[1], 'latest_sha') == ARGV[4] then return {n, 0} end
redis.call('RPUSH', KEYS[2], ARGV[2])
n = n + 1
redis.call('HSET', KEYS[1], 'latest_sha', ARGV[4])
redis.call('RPUSH', KEYS[4], '{"action":"updated","version":' .. n .. ',"at":' .. ARGV[3] .. '}')
if ARGV[5] == '1' then
  local cur = redis.call('HGET', KEYS[1], 'active')
  redis.call('HSET', KEYS[1], 'active', n)
  redis.call('RPUSH', KEYS[3], n)
  redis.call('RPUSH', KEYS[4],
    '{"action":"activated","version":' .. n .. ',"previous":' .. cur .. ',"at":' .. ARGV[3] .. '}')
  redis.call('PUBLISH', KEYS[5], ARGV[1] .. ':' .. n)
end
return {n, 1}
