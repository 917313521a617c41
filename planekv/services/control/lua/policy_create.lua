-- Create a placement policy; its first version is active.
-- KEYS: policy hash, versions, activation stack, history, policies zset, channel; ARGV: name, version doc, now, sha256
-- Returns 1 = created, 0 = exists.
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], 'created_at', ARGV[3], 'active', 1, 'latest_sha', ARGV[4])
redis.call('RPUSH', KEYS[2], ARGV[2])
redis.call('RPUSH', KEYS[3], 1)
redis.call('RPUSH', KEYS[4], '{"action":"created","version":1,"at":' .. ARGV[3] .. '}')
redis.call('ZADD', KEYS[5], ARGV[3], ARGV[1])
redis.call('PUBLISH', KEYS[6], ARGV[1] .. ':1')
return 1
