-- token_bucket: a bucket of burst tokens, full at first, refilled
-- continuously at limit per period; a call takes n tokens or none.
--
-- Tokens are kept exactly as integers in units of 1/period: one token is
-- period units and the bucket gains limit units per µs, so no fraction is
-- ever rounded away.
--
-- KEYS[1] -> hash {t = tokens × period, l = µs of the last admitted call}
-- ARGV    -> now, limit, period, burst, windows (unused), n, ttl slack (see prelude)
-- Output  -> {allowed (1|0), remaining, retry_after µs, reset_after µs}

local key = KEYS[1]
local capacity = burst * period
local cost = n * period
local state = redis.call('HMGET', key, 't', 'l')
local tokens, last = capacity, now
if state[1] then
  tokens = math.min(capacity, tonumber(state[1]))
  last = tonumber(state[2])
end
-- A clock that stepped back refills nothing and does not move last back;
-- then the refill starts `ahead` µs from now.
if now > last then
  local elapsed = now - last
  if elapsed >= ceildiv(capacity - tokens, limit) then
    tokens = capacity
  else
    tokens = tokens + elapsed * limit
  end
  last = now
end
local ahead = last - now

if tokens < cost then
  return {0, floordiv(tokens, period), ahead + ceildiv(cost - tokens, limit), ahead + ceildiv(capacity - tokens, limit)}
end

tokens = tokens - cost
local reset = ahead + ceildiv(capacity - tokens, limit)
redis.call('HSET', key, 't', int(tokens), 'l', int(last))
keep_for(key, reset)
return {1, floordiv(tokens, period), 0, reset}
