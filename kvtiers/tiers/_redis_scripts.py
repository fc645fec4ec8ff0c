"""The redis tier's Lua scripts: a put that evicts by recency, and the touch of a read.

Each runs atomically on the server. Both take the tier's recency set (a sorted set of
chunk keys, each scored by the time of its last write or read) as KEYS[1], then chunk keys.
A chunk written cold (a reuse hint: none expected) and not read since is scored by its
write's time less `COLD_SHIFT`, so it sorts before every other (oldest first) and its
time is still known for the ttl.
"""

from __future__ import annotations

__all__ = ["COLD_SHIFT", "PUT_SCRIPT", "TOUCH_SCRIPT"]

COLD_SHIFT = 2**33
"""Seconds taken off a cold chunk's score: every cold score is below zero until 2242."""

# KEYS[1]: the recency set; KEYS[2..]: chunk keys. ARGV[1]: now (seconds); ARGV[2]: the most
# entries the capacity holds; ARGV[3]: ttl in ms (0: none); ARGV[4]: now less COLD_SHIFT;
# ARGV[5]: one "1" (cold) or "0" per chunk key; ARGV[6..]: the values, aligned.
# Returns per key 0 (not held), 1 (held before) or 2 (written now), the set's size, then the
# names it evicted (by capacity, or listed in the set past their ttl). The batch's scores
# step down by a microsecond per key, so a prefix is more recent than its suffix; NOTE: they
# are written with 17 digits, since Lua prints a number with 14 (a tenth of a millisecond).
PUT_SCRIPT = """
local zset, now, limit, ttl = KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local cold_now, evicted = tonumber(ARGV[4]), {}
local function score(base, i)
  return string.format('%.17g', base + (#KEYS - i) * 0.000001)
end
if ttl > 0 then
  local cutoff = now - ttl / 1000
  for _, low in ipairs({{'0', cutoff}, {'-inf', cutoff - 8589934592}}) do  -- COLD_SHIFT
    local past = redis.call('ZRANGEBYSCORE', zset, low[1], '(' .. low[2])
    redis.call('ZREMRANGEBYSCORE', zset, low[1], '(' .. low[2])
    for _, name in ipairs(past) do evicted[#evicted + 1] = name end
  end
end
local count = redis.call('ZCARD', zset)
local out, full = {}, false
for i = 2, #KEYS do
  local key, held = KEYS[i], 0
  local known = redis.call('ZSCORE', zset, key)
  if known and redis.call('EXISTS', key) == 1 then
    redis.call('ZADD', zset, score(now, i), key)
    if ttl > 0 then redis.call('PEXPIRE', key, ttl) end
    held = 1
  elseif not full then
    local cold = string.sub(ARGV[5], i - 1, i - 1) == '1'
    if known then
      redis.call('ZREM', zset, key)
      count = count - 1
    end
    while count >= limit do
      local oldest = redis.call('ZRANGE', zset, 0, 0, 'WITHSCORES')
      local age = #oldest > 0 and tonumber(oldest[2])
      -- NOTE: a cold chunk takes room only from cold ones (scored below zero).
      if not age or age >= now or (cold and age >= 0)
          or (age >= cold_now and age < cold_now + #KEYS * 0.000001) then
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
        redis.call('SET', key, ARGV[i + 4], 'PX', ttl)
      else
        redis.call('SET', key, ARGV[i + 4])
      end
      redis.call('ZADD', zset, score(cold and cold_now or now, i), key)
      count, held = count + 1, 2
    end
  end
  out[#out + 1] = held
end
out[#out + 1] = count
for _, name in ipairs(evicted) do out[#out + 1] = name end
return out
"""

# KEYS[1]: the recency set; KEYS[2..]: chunk keys that were read. ARGV[1]: now (seconds).
# Answers the recency set's size and how many of the keys were cold (scored below zero).
TOUCH_SCRIPT = """
local cold = 0
for i = 2, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 1 then
    local old = redis.call('ZSCORE', KEYS[1], KEYS[i])
    if old and tonumber(old) < 0 then cold = cold + 1 end
    redis.call('ZADD', KEYS[1], 'XX', ARGV[1], KEYS[i])
  end
end
return {redis.call('ZCARD', KEYS[1]), cold}
"""
