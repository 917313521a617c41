-- Register a format (formats are immutable).
-- KEYS: format hash, formats zset; ARGV: spec JSON, now, format_id
-- Returns 1 = created, 0 = already registered with this spec, -1 = registered with another spec.
local cur = redis.call('HGET', KEYS[1], 'spec')
if cur then
  if cur == ARGV[1] then return 0 end
  return -1
end
redis.call('HSET', KEYS[1], 'spec', ARGV[1], 'created_at', ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[3])
return 1
