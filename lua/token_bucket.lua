-- token_bucket: a bucket of burst tokens, full at first, refilled
-- continuously at limit per period; a call takes n tokens or none.
--
-- Tokens are kept exactly as integers in units of 1/period: one token is
-- period units and the bucket gains limit units per µs, so no fraction is
-- ever rounded away.
--
-- KEYS[1] -> string "t l b": tokens × period (-1: a full bucket), µs of the
--            last call counted, µs until which the key is blocked (0: not)
-- KEYS[2] -> unused (see lua.go)
-- ARGV    -> now, limit, period, burst, windows (unused), n, ttl slack,
--            op, op argument, not before (see lua.go and epilogue.lua)

local key = KEYS[1]
local capacity, cost = burst * period, n * period
local stored, last, blocked = -1, 0, 0
local state = redis.call('GET', key)
if state then stored, last, blocked = unpack_state(state) end

-- refill returns the tokens at `at` and the instant they refill from: later
-- than `at` when a call was counted after it (a reservation, or a clock that
-- stepped back), and then nothing refills before that instant.
local function refill(at)
  if stored < 0 then return capacity, at end
  local tokens = math.min(capacity, stored)
  if at <= last then return tokens, last end
  local elapsed = at - last
  if elapsed >= ceildiv(capacity - tokens, limit) then return capacity, at end
  return tokens + elapsed * limit, at
end

-- The tokens of a bucket counted up to a later instant exist from then on
-- only, so nothing fits before it (else a cancelled reservation would give
-- back tokens early).
local function decide(at)
  local tokens, from = refill(at)
  local ahead = from - at
  if ahead > 0 or tokens < cost then
    local remaining = 0
    if ahead == 0 then remaining = floordiv(tokens, period) end
    return false, remaining, ahead + ceildiv(math.max(0, cost - tokens), limit), ahead + ceildiv(capacity - tokens, limit)
  end
  return true, floordiv(tokens - cost, period), 0, ahead + ceildiv(capacity - tokens + cost, limit)
end

local function record(at, ttl)
  local tokens, from = refill(at)
  redis.call('SET', key, pack_state(tokens - cost, from, blocked), 'PX', ttl)
end

-- Tokens are given back only while nothing was counted after them: later
-- calls were decided with them gone, and the bucket may have been full
-- since, so giving them back then could overfill it.
local function give_back(at)
  if stored >= 0 and last == at then
    redis.call('SET', key, pack_state(math.min(capacity, stored + cost), last, blocked), 'KEEPTTL')
  end
end

local function block(ttl)
  redis.call('SET', key, pack_state(stored, last, blocked), 'PX', ttl)
end
