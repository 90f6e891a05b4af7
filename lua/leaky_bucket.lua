-- leaky_bucket: a bucket of size burst, empty at first, leaking
-- continuously at limit per period; a call pours n in if they fit.
--
-- The level is kept exactly as an integer in units of 1/period: one event is
-- period units and the bucket loses limit units per µs.
--
-- KEYS[1] -> string "v l b": level × period, µs of the last call counted
--            (0 with level 0: an empty bucket), µs until which the key is
--            blocked (0: not)
-- KEYS[2] -> unused (see lua.go)
-- ARGV    -> now, limit, period, burst, windows (unused), n, ttl slack,
--            op, op argument, not before (see lua.go and epilogue.lua)

local key = KEYS[1]
local capacity, cost = burst * period, n * period
local stored, last, blocked = 0, 0, 0
local state = redis.call('GET', key)
if state then stored, last, blocked = unpack_state(state) end

-- leak returns the level at `at` and the instant it leaks from: later than
-- `at` when a call was counted after it (a reservation, or a clock that
-- stepped back), and then nothing leaks before that instant.
local function leak(at)
  if at <= last then return stored, last end
  local elapsed = at - last
  if elapsed >= ceildiv(stored, limit) then return 0, at end
  return stored - elapsed * limit, at
end

-- The level of a bucket counted up to a later instant holds from then on
-- only, so nothing fits before it (else a cancelled reservation would make
-- room early).
local function decide(at)
  local level, from = leak(at)
  local ahead = from - at
  if ahead > 0 or level + cost > capacity then
    local remaining = 0
    if ahead == 0 then remaining = floordiv(math.max(0, capacity - level), period) end
    return false, remaining, ahead + ceildiv(math.max(0, level + cost - capacity), limit), ahead + ceildiv(level, limit)
  end
  return true, floordiv(capacity - level - cost, period), 0, ahead + ceildiv(level + cost, limit)
end

local function record(at, ttl)
  local level, from = leak(at)
  redis.call('SET', key, pack_state(level + cost, from, blocked), 'PX', ttl)
end

-- Room is made only while nothing was counted after the events given back:
-- later calls were decided with them in, and the bucket may have run empty
-- since, so making room then could let it overflow.
local function give_back(at)
  if state and last == at then
    redis.call('SET', key, pack_state(math.max(0, stored - cost), last, blocked), 'KEEPTTL')
  end
end

local function block(ttl)
  redis.call('SET', key, pack_state(stored, last, blocked), 'PX', ttl)
end
