-- adapt: the controller of an adaptive quota's rate (jobs/adapt.go). Every
-- worker sends it what its calls' upstream answered since its last call, a
-- few times a second; it keeps one learned rate for the fleet, beside the
-- quota's reports, and returns it. Rates are events per the quota's period,
-- kept as Lua numbers (fractions are kept: a rate of 19.6 rounds to 20 when
-- it is put in force, and grows past it by small steps).
--
-- KEYS[1] -> the quota's adaptive state, a hash
-- ARGV[1] -> now in µs, or "" for Redis's TIME
-- ARGV[2] -> min rate, ARGV[3] -> max rate, ARGV[4] -> start rate
-- ARGV[5] -> the quota's period in µs
-- ARGV[6] -> calls answered as success since the last report
-- ARGV[7] -> calls answered 429/503 ("slow down") since the last report
-- ARGV[8] -> the lowest limit an upstream stated, per period (0: none)
-- ARGV[9] -> 1 if an upstream said its allowance is nearly used up, else 0
-- ARGV[10] -> the state's TTL in seconds (refreshed by every call)
-- Output  -> {rate, rate before this call, cause of a change or "",
--             recent successes per period, the limit in force (the rate
--             rounded), µs when that limit was set}, numbers as strings.
--             The limit and its time name the limit's state in every
--             worker alike (jobs: LimitConfig.generation), so that a
--             limit left and come back to books on a fresh state.
--
-- The controller, per quota (docs/adaptive.md explains the choice):
-- * A stated limit is taken as it is, at once, and for statedHold no probe
--   goes above it.
-- * "Slow down" (a 429 or 503, or an allowance nearly used up) cuts the
--   rate: the first of an episode by beta; one more than a second later,
--   while they continue, to 95% of what the upstream let through since the
--   cut (the upstream's real rate, measured) if that is lower still
--   (90% of it: the upstream's bucket is empty then, and refills only by
--   what the rate leaves). One
--   burst of 429s counts once: a second cut waits a second.
-- * While calls succeed and the rate is used (its recent successes at
--   least `busyEnough` of it: an idle quota does not creep up), once a
--   second: with no ceiling known, times growth; under 95% of the ceiling
--   (what the upstream let through before the last cut), half the way to
--   it; past it, a probe that starts at 4% of the ceiling and doubles each
--   second (at most the ceiling), so a raised limit is found in
--   seconds and an unchanged one is passed by little.
local key = KEYS[1]
local now = tonumber(ARGV[1])
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end
local lo, hi, start = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local period = tonumber(ARGV[5])
local ok, busy = tonumber(ARGV[6]), tonumber(ARGV[7])
local stated, low = tonumber(ARGV[8]), ARGV[9] == '1'
local ttl = tonumber(ARGV[10])

local second = 1000000
local beta, busyEnough, growth, settle = 0.7, 0.8, 1.25, 0.9
local statedHold = 60 * second
-- near: the rate approaches this share of the ceiling quickly; past it,
-- it probes.
local near = 0.95

local function clamp(x)
  if x < lo then return lo end
  if x > hi then return hi end
  return x
end

local h = redis.call('HMGET', key, 'r', 'c', 'at', 'cut', 'sc', 'k', 'w', 's', 'sp', 'st', 'l', 'g')
local r = clamp(tonumber(h[1]) or start)
local ceiling = tonumber(h[2]) or 0
local at = tonumber(h[3]) or 0      -- last change
local cut = tonumber(h[4]) or 0     -- last cut
local sinceCut = tonumber(h[5]) or 0 -- successes since the last cut
local k = tonumber(h[6]) or 0        -- probe steps since the ceiling was reached
local w = tonumber(h[7]) or now      -- start of the current second of successes
local s = tonumber(h[8]) or 0        -- successes in it
local sp = tonumber(h[9]) or 0       -- successes in the second before it
local statedUntil = tonumber(h[10]) or 0
local limit = tonumber(h[11]) or 0   -- the rate rounded, as put in force
local limitAt = tonumber(h[12]) or now

-- Successes over the last second, by whole seconds: the current one and the
-- part of the one before that the last second still covers.
local elapsed = now - w
if elapsed >= 2 * second or elapsed < 0 then
  sp, s, w = 0, 0, now
elseif elapsed >= second then
  sp, s, w = s, 0, w + second
end
s = s + ok
sinceCut = sinceCut + ok
local recent = (s + sp * math.max(0, 1 - (now - w) / second)) * period / second

local before = r
local cause = ''
if stated > 0 then
  if math.abs(stated - r) > 0.005 * r or ceiling ~= stated then
    r = clamp(stated)
    ceiling, k, cause = stated, 0, 'stated limit'
  end
  statedUntil = now + statedHold
elseif (busy > 0 or low) and now - cut >= second then
  local measured = 0
  if cut > 0 and now - cut < 3 * second then
    -- Still answered "slow down" since the last cut: what got through
    -- since then is the upstream's rate now.
    measured = sinceCut * period / (now - cut)
  end
  ceiling = math.min(recent, r)
  r = beta * r
  if measured > 0 then
    r = math.min(r, settle * measured)
    ceiling = measured
  end
  r = clamp(r)
  cut, sinceCut, k = now, 0, 0
  cause = 'slow down'
  if busy == 0 then cause = 'allowance low' end
elseif ok > 0 and busy == 0 and now - at >= second and now - cut >= second and recent >= busyEnough * r then
  if ceiling <= 0 then
    r = r * growth
  elseif r < 0.999 * near * ceiling then -- (r is kept to 6 decimals)
    r = math.min(near * ceiling, r + math.max((near * ceiling - r) / 2, 0.01 * ceiling))
  elseif now >= statedUntil then
    r = r + math.min(0.04 * ceiling * 2 ^ k, ceiling)
    k = k + 1
  end
  r = clamp(r)
  if r ~= before then cause = 'successes' end
end
if cause ~= '' then at = now end
local rounded = math.max(1, math.floor(r + 0.5))
if rounded ~= limit then limit, limitAt = rounded, now end

redis.call('HSET', key, 'r', string.format('%.6f', r), 'c', string.format('%.6f', ceiling), 'at', int(at), 'cut', int(cut),
  'sc', int(sinceCut), 'k', int(k), 'w', int(w), 's', int(s), 'sp', int(sp), 'st', int(statedUntil),
  'l', int(limit), 'g', int(limitAt))
redis.call('EXPIRE', key, ttl)
return {string.format('%.6f', r), string.format('%.6f', before), cause, string.format('%.6f', recent), int(limit), int(limitAt)}
