-- Forget a store id whose heartbeat is older than the grace period: remove its block index entries.
-- KEYS: heartbeats hash, stores hash, tierstats, the store's keys set, then the blocks hash of each field
-- ARGV: store id, grace_s, then the fields ('<block key>@<store id>'; ARGV[i] lives in KEYS[i + 2])
-- Returns {entries removed, seconds since the last heartbeat or -1 if none}; called with no fields, it also
-- forgets the store's record and heartbeat once its keys set is empty. An error 'ALIVE <age>' if the heartbeat
-- is within the grace period (nothing removed): checked here, so a store starting again (it beats before it
-- republishes) cannot lose the entries it has just written.
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local beat = redis.call('HGET', KEYS[1], ARGV[1])
local age = -1
if beat then
  age = now - tonumber(beat)
  if age <= tonumber(ARGV[2]) then return redis.error_reply('ALIVE ' .. string.format('%.1f', age)) end
end
local removed = 0
for i = 3, #ARGV do
  local bk = KEYS[i + 2]
  local old = redis.call('HGET', bk, ARGV[i])
  redis.call('SREM', KEYS[4], ARGV[i])
  if old then
    local o = cjson.decode(old)
    for _, tier in ipairs(o.tiers) do
      redis.call('HINCRBY', KEYS[3], tier .. ':blocks', -1)
      redis.call('HINCRBY', KEYS[3], tier .. ':bytes', -o.size)
    end
    redis.call('HDEL', bk, ARGV[i])
    removed = removed + 1
  end
end
if #ARGV == 2 and redis.call('SCARD', KEYS[4]) == 0 then
  redis.call('HDEL', KEYS[2], ARGV[1])
  redis.call('HDEL', KEYS[1], ARGV[1])
end
return {removed, string.format('%.3f', age)}
