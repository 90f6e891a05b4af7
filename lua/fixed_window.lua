-- fixed_window: at most limit events in each window [k*period, (k+1)*period).
--
-- KEYS[1] -> hash {w = index of the window counted, c = events counted in it}
-- ARGV    -> now, limit, period, burst (unused), windows (unused), n, ttl slack,
--            op, op argument (see lua.go and epilogue.lua)

local key = KEYS[1]
local state = redis.call('HMGET', key, 'w', 'c')
local stored, count = tonumber(state[1]), tonumber(state[2]) -- nil: no state

local function decide(at)
  local window = floordiv(at, period)
  if stored and stored > window then
    -- A later window is counted already (a reservation, or a clock that
    -- stepped back): nothing fits before it starts, and then what it has left.
    local later_end = (stored + 1) * period - at
    if count + n <= limit then return false, 0, stored * period - at, later_end end
    return false, 0, later_end, later_end
  end
  local used = 0
  if stored == window then used = count end
  local window_end = (window + 1) * period - at
  if used + n > limit then return false, math.max(0, limit - used), window_end, window_end end
  return true, limit - used - n, 0, window_end
end

local function record(at)
  local window = floordiv(at, period)
  if stored == window then
    count = count + n
  else
    stored, count = window, n
  end
  redis.call('HSET', key, 'w', int(stored), 'c', int(count))
end

local function give_back(at)
  if stored == floordiv(at, period) then
    redis.call('HSET', key, 'c', int(math.max(0, count - n)))
  end
end
