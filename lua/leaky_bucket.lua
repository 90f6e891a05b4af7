-- leaky_bucket: a bucket of size burst, empty at first, leaking
-- continuously at limit per period; a call pours n in if it fits.
--
-- The level is kept exactly as an integer in units of 1/period: one event is
-- period units and the bucket loses limit units per µs.
--
-- KEYS[1] -> hash {v = level × period, l = µs of the last admitted call}
-- ARGV    -> now, limit, period, burst, windows (unused), n, ttl slack (see prelude)
-- Output  -> {allowed (1|0), remaining, retry_after µs, reset_after µs}

local key = KEYS[1]
local capacity = burst * period
local cost = n * period
local state = redis.call('HMGET', key, 'v', 'l')
local level, last = 0, now
if state[1] then
  level = tonumber(state[1])
  last = tonumber(state[2])
end
-- A clock that stepped back leaks nothing and does not move last back;
-- then the leak starts `ahead` µs from now.
if now > last then
  local elapsed = now - last
  if elapsed >= ceildiv(level, limit) then
    level = 0
  else
    level = level - elapsed * limit
  end
  last = now
end
local ahead = last - now

if level + cost > capacity then
  local free = math.max(0, capacity - level)
  return {0, floordiv(free, period), ahead + ceildiv(level + cost - capacity, limit), ahead + ceildiv(level, limit)}
end

level = level + cost
local reset = ahead + ceildiv(level, limit)
redis.call('HSET', key, 'v', int(level), 'l', int(last))
keep_for(key, reset)
return {1, floordiv(capacity - level, period), 0, reset}
