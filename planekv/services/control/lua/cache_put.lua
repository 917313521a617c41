-- Register a sequence with its format (a sequence has one format).
-- KEYS: cache hash, caches zset; ARGV: format_id, now, sequence_id, then field/value pairs to set
-- Returns 1 = created, 0 = updated; an error 'FORMAT <format_id>' if registered with another format.
local fid = redis.call('HGET', KEYS[1], 'format_id')
if fid and fid ~= ARGV[1] then return redis.error_reply('FORMAT ' .. fid) end
local created = 0
if not fid then
  redis.call('HSET', KEYS[1], 'format_id', ARGV[1], 'created_at', ARGV[2])
  redis.call('ZADD', KEYS[2], 'NX', ARGV[2], ARGV[3])
  created = 1
end
redis.call('HSET', KEYS[1], 'source', 'api')
for i = 4, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
return created
