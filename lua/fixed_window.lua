-- fixed_window: at most limit events in each window [k*period, (k+1)*period).
--
-- KEYS[1] -> hash {w = index of the window counted, c = events admitted in it}
-- ARGV    -> now, limit, period, burst (unused), windows (unused), n, ttl slack (see prelude)
-- Output  -> {allowed (1|0), remaining, retry_after µs, reset_after µs}

local window = floordiv(now, period)
local state = redis.call('HMGET', KEYS[1], 'w', 'c')
local count = 0
if state[1] then
  local stored = tonumber(state[1])
  -- A window ahead of ours means the clock stepped back: keep counting it.
  if stored >= window then
    window = stored
    count = tonumber(state[2])
  end
end
local window_end = (window + 1) * period - now

if count + n > limit then
  return {0, math.max(0, limit - count), window_end, window_end}
end

count = count + n
redis.call('HSET', KEYS[1], 'w', int(window), 'c', int(count))
keep_for(KEYS[1], window_end)
return {1, limit - count, 0, window_end}
