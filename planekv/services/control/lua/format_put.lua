-- Register a format (formats are immutable) whose calibration is registered.
-- KEYS: format hash, formats zset, calibration hash; ARGV: spec JSON, now, format_id
-- Returns 1 = created, 0 = already registered with this spec, -1 = registered with another spec,
-- -2 = its calibration is not registered (nothing written; checked here so no delete can slip between).
local cur = redis.call('HGET', KEYS[1], 'spec')
if cur then
  if cur == ARGV[1] then return 0 end
  return -1
end
if redis.call('EXISTS', KEYS[3]) == 0 then return -2 end
redis.call('HSET', KEYS[1], 'spec', ARGV[1], 'created_at', ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[3])
return 1
