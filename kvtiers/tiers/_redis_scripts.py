"""The redis tier's Lua scripts: a put that evicts by recency, and the touch of a read.

Each runs atomically on the server. Both take the tier's recency set (a sorted set of
chunk keys, each scored by the time of its last write or read) as KEYS[1], then chunk keys.
"""

from __future__ import annotations

__all__ = ["PUT_SCRIPT", "TOUCH_SCRIPT"]

# KEYS[1]: the recency set; KEYS[2..]: chunk keys. ARGV[1]: now (seconds); ARGV[2]: the most
# entries the capacity holds; ARGV[3]: ttl in ms (0: none); ARGV[4..]: the values, aligned.
# Returns a 0/1 per key (held after the call), the set's size, then the names it evicted
# (by capacity, or listed in the set past their ttl).
PUT_SCRIPT = """
local zset, now, limit, ttl = KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local evicted = {}
if ttl > 0 then
  local cutoff = '(' .. (now - ttl / 1000)
  evicted = redis.call('ZRANGEBYSCORE', zset, '-inf', cutoff)
  redis.call('ZREMRANGEBYSCORE', zset, '-inf', cutoff)
end
local count = redis.call('ZCARD', zset)
local out, full = {}, false
for i = 2, #KEYS do
  local key, held = KEYS[i], 0
  local known = redis.call('ZSCORE', zset, key)
  if known and redis.call('EXISTS', key) == 1 then
    redis.call('ZADD', zset, ARGV[1], key)
    if ttl > 0 then redis.call('PEXPIRE', key, ttl) end
    held = 1
  elseif not full then
    if known then
      redis.call('ZREM', zset, key)
      count = count - 1
    end
    while count >= limit do
      local oldest = redis.call('ZRANGE', zset, 0, 0, 'WITHSCORES')
      if #oldest == 0 or tonumber(oldest[2]) >= now then
        full = true
        break
      end
      redis.call('ZREM', zset, oldest[1])
      redis.call('UNLINK', oldest[1])
      count = count - 1
      evicted[#evicted + 1] = oldest[1]
    end
    if not full then
      if ttl > 0 then
        redis.call('SET', key, ARGV[i + 2], 'PX', ttl)
      else
        redis.call('SET', key, ARGV[i + 2])
      end
      redis.call('ZADD', zset, ARGV[1], key)
      count, held = count + 1, 1
    end
  end
  out[#out + 1] = held
end
out[#out + 1] = count
for _, name in ipairs(evicted) do out[#out + 1] = name end
return out
"""

# KEYS[1]: the recency set; KEYS[2..]: chunk keys that were read. ARGV[1]: now (seconds).
TOUCH_SCRIPT = """
for i = 2, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 1 then
    redis.call('ZADD', KEYS[1], 'XX', ARGV[1], KEYS[i])
  end
end
return redis.call('ZCARD', KEYS[1])
"""
