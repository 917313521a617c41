-- Publish a calibration's metadata (after its artifact file is written).
-- KEYS: calibration hash, calibrations zset, registration counter; ARGV: id, sha256, now, then field/value pairs
-- Returns {1, version} = created, {0, version} = same sha256 already there, {-1, sha256} = other bytes registered.
local cur = redis.call('HGET', KEYS[1], 'sha256')
if cur then
  if cur == ARGV[2] then return {0, redis.call('HGET', KEYS[1], 'version')} end
  return {-1, cur}
end
local v = redis.call('INCR', KEYS[3])
redis.call('HSET', KEYS[1], 'sha256', ARGV[2], 'created_at', ARGV[3], 'version', v)
for i = 4, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
redis.call('ZADD', KEYS[2], v, ARGV[1])
return {1, v}
