-- fixed_window: at most limit events in each window [k*period, (k+1)*period).
--
-- KEYS[1] -> string "w c b": index of the window counted (-1: none), events
--            counted in it, µs until which the key is blocked (0: not)
-- KEYS[2] -> unused (see lua.go)
-- ARGV    -> now, limit, period, burst (unused), windows (unused), n, ttl slack,
--            op, op argument, not before (see lua.go and epilogue.lua)

local key = KEYS[1]
local stored, count, blocked = -1, 0, 0 -- stored -1: no window counted
local state = redis.call('GET', key)
if state then stored, count, blocked = unpack_state(state) end

local function decide(at)
  local window = floordiv(at, period)
  if stored > window then
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

local function record(at, ttl)
  local window = floordiv(at, period)
  if stored == window then
    count = count + n
  else
    stored, count = window, n
  end
  redis.call('SET', key, pack_state(stored, count, blocked), 'PX', ttl)
end

local function give_back(at)
  if stored == floordiv(at, period) then
    redis.call('SET', key, pack_state(stored, math.max(0, count - n), blocked), 'KEEPTTL')
  end
end

local function block(ttl)
  redis.call('SET', key, pack_state(stored, count, blocked), 'PX', ttl)
end
