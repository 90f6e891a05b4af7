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
-- ARGV[11] -> 1 if the limit in force may be a fraction of an event per
--             period (a bucket's: jobs puts 1.8/s in force as 18/10s),
--             else 0 (whole events per period)
-- ARGV[12] -> µs between one worker's reports (jobs: adaptEvery)
-- Output  -> {rate, rate before this call, cause of a change or "",
--             recent successes per period, the limit in force (the rate
--             rounded), µs when that limit was set, the ceiling (0: no
--             limit of the upstream met yet)}, numbers as strings.
--             The limit and its time name the limit's state in every
--             worker alike (jobs: LimitConfig.generation), so that a
--             limit left and come back to books on a fresh state.
--
-- The controller, per quota (docs/adaptive.md explains the choice):
-- * A stated limit is taken as it is, at once, and for statedHold no probe
--   goes above it.
-- * "Slow down" (a 429 or 503, or an allowance nearly used up) cuts the
--   rate to 90% (settle) of the ceiling, the rate before the last raise
--   (it held a second without a "slow down" from any worker; none known: the successes
--   of the last second, one more if 1 to fewCounted - 1), by beta at most. If the upstream
--   refused a real share of the calls since the last cut (at least
--   `refused` of them, and 5) within 3 s of it, its limit fell: the
--   ceiling is what got through since the cut (the upstream's real rate,
--   measured; one more success if 1 to fewCounted - 1 got through), or,
--   if lower, the share that got through of the calls sent at the limit
--   in force times it; the rate 90% of that if lower still. One burst of
--   429s counts once: a second cut waits a second.
-- * While calls succeed and the rate is used (its recent successes, give
--   or take the one event a count over a second is known to, at least
--   `busyEnough` of it: an idle quota does not creep up), once a second:
--   with no ceiling known, times growth; under 95% of the ceiling, half
--   the way to it; past it, a probe that starts at 4% of the ceiling and
--   doubles each second, or each probeCalls calls' time if longer (at
--   most the ceiling a step, and at least the next limit up in force),
--   so a raised limit is found
--   in seconds and an unchanged one is passed by little. After a cut below
--   a rate that held, the first probe waits `plateau` from the cut: the
--   limit was where it was.
-- * A probe that failed bounds the limit from above: the next probes go at
--   most halfway to it. One that fails within `known` of the rate that
--   held, or one limit in force above it, makes the limit known: taken as
--   halfway between the two limits put in force, and probed past only
--   after plateauCalls calls' time.
-- * Below 10 a period, where limits go in force by tenths (a tenth is 5%
--   of 2/s), the upstream's view decides: a raise that put a higher limit
--   in force than the rate that held is a probe, wherever the ceiling
--   was, and a probe that failed goes back to the rate that held, the
--   next step probeCalls calls' time later (a cut to 90% of it put 1.7/s
--   in force at 2/s, and the climb back took 10 s of
--   TestAdaptiveKeyedQuota's measure).
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
local fine = ARGV[11] == '1'
local every = tonumber(ARGV[12]) or 0

-- inForce is the limit put in force for a rate x: whole events per
-- period, or tenths below 10 where fractions may be put in force (a rate
-- of 2 rounded to 1 or 2 would be half the upstream's limit, or all of it
-- and a 429 at every late call).
local function inForce(x)
  if fine and x < 10 then return math.max(0.1, math.floor(x * 10 + 0.5) / 10) end
  return math.max(1, math.floor(x + 0.5))
end

-- quantum is the step from the limit in force for x to the next one.
local function quantum(x)
  if fine and inForce(x) < 10 then return 0.1 end
  return 1
end

local second = 1000000
local beta, busyEnough, growth, settle = 0.7, 0.8, 1.25, 0.9
-- refused: the share of calls refused since the last cut above which the
-- upstream's rate is measured by what got through.
local refused = 0.2
-- fewCounted: a measure of the upstream's rate from at least one success
-- but fewer than this takes one more (see below).
local fewCounted = 5
local statedHold = 60 * second
-- plateau: no probe this soon after a cut below a rate that held.
local plateau = 6 * second
-- plateauCalls: a limit known within `known` is probed past only after
-- this many calls' time at it (or plateau, the longer from 17 calls a
-- second on): a probe past the limit of an upstream that allows no burst
-- costs a 429, a lost call and a cut, and at 2 calls a second a probe 6 s
-- after each cut was one every dozen calls (issue 23's destinations of 2
-- and 3/s).
local plateauCalls = 100
-- probeCalls: a probe's next step waits this many calls' time at the rate
-- it leaves, or a second if longer (from 5 calls a second on): a rate is
-- said to hold when none of these calls met a "slow down".
local probeCalls = 5
local known = 0.05
-- near: the rate approaches this share of the ceiling quickly; past it,
-- it probes.
local near = 0.95

local function clamp(x)
  if x < lo then return lo end
  if x > hi then return hi end
  return x
end

local h = redis.call('HMGET', key, 'r', 'c', 'at', 'cut', 'sc', 'k', 'w', 's', 'sp', 'st', 'l', 'g', 'sb', 'pr', 'pa', 'fp', 'sf', 'bf', 'lb')
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
local sinceBusy = tonumber(h[13]) or 0 -- calls refused since the last cut
local held = tonumber(h[14]) or 0 -- the rate before the last raise: it held a second without a 429
local probeAt = tonumber(h[15]) or 0 -- no probe past the ceiling before
local failed = tonumber(h[16]) or 0 -- the last probe that failed, while the limit lies between it and the ceiling
local lastBusy = tonumber(h[19]) or 0 -- the last report of a "slow down", from any worker
local sinceFresh = tonumber(h[17]) or 0 -- successes reported from `every` after the last cut on (see below)
local busyFresh = tonumber(h[18]) or 0 -- and calls refused

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
if limit > 0 and now - cut >= math.max(every, 2 * period / limit) then
  sinceFresh, busyFresh = sinceFresh + ok, busyFresh + busy
end
sinceBusy = sinceBusy + busy
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
  -- A probe: the rate was raised past `near` of the ceiling it had (a
  -- rate held there that meets a "slow down" met a limit that fell).
  -- In tenths, any raise that put a higher limit in force is one (an
  -- approach to 95% of a measured ceiling of 2.1 put 2.0 in force).
  local probed = held > 0 and ceiling > 0 and (r > near * ceiling * 1.000001 -- (r and the ceiling are kept to 6 decimals)
    or quantum(r) < 1 and inForce(r) > inForce(held))
  -- With no rate held since the last cut, the ceiling is what got through
  -- over the last second; of a few events (1 to fewCounted - 1), give or
  -- take the one such a count is known to, the upper end, as a measured
  -- cut takes it (at 2/s a late call's lone 429 a second after a cut
  -- found one success there, and took the limit for 1/s).
  local seen = recent
  if seen > 0 and seen * second / period < fewCounted then seen = seen + period / second end
  ceiling = math.min(r, held > 0 and held or seen)
  if cut > 0 and now - cut < 3 * second and sinceBusy >= 5 and sinceBusy >= refused * (sinceCut + sinceBusy) then
    -- Still refused a real share of the calls since the last cut: what
    -- got through since then is the upstream's rate now.
    -- A count over a second or so is known to one event: of a few, the
    -- upper end is taken (at 2/s, one success that a late call moved out
    -- of the count made the rate half the limit, and it grows back slowly).
    -- None is no measure: the upstream let nothing through (down, or
    -- blocking), and with no ceiling the rate grows back by growth.
    -- That count overstates the rate right after a fall of the limit:
    -- each worker's first report after the cut holds calls from before
    -- it, when the upstream let more through (the rest of its burst; at a
    -- fall from 50/s to 20/s it made 23/s, and the 429s went on for up to
    -- 2.9 s). The calls in the reports from one report's time after the
    -- cut on (or two calls' time at the limit in force, if longer) went
    -- out at that limit: the share of them that got through, times the
    -- limit, measures the rate without that error. Where they hold enough
    -- successes, the lower of the two measures is taken.
    local got = sinceCut
    if got > 0 and got < fewCounted then got = got + 1 end
    ceiling = got * period / (now - cut)
    if sinceFresh >= fewCounted then
      ceiling = math.min(ceiling, limit * sinceFresh / (sinceFresh + busyFresh))
    end
    r = math.min(beta * r, settle * ceiling)
    probeAt = now
  else
    probeAt = now
    if held > 0 then probeAt = now + plateau end
    if probed then
      -- A probe failed: the limit lies between the rate that held and
      -- this one. The next probes halve that gap, a plateau apart (in
      -- tenths, probeCalls calls' time apart: see below); once it
      -- is under `known` of the rate that held, the limit is known and
      -- probes wait plateauCalls calls' time.
      failed = r
    end
    if probed and quantum(held) < 1 then
      -- In tenths, back to the rate that held: it held probeCalls calls
      -- at least, and an upstream that allows so few calls lets few
      -- through as a burst to hide a rate above its limit.
      r = held
      probeAt = now + math.max(second, probeCalls * period / held)
    else
      r = math.min(r, math.max(beta * r, settle * ceiling))
    end
    if probed and (failed - held < known * held or inForce(failed) - inForce(held) <= quantum(held) * 1.001) then
      -- The limit is known, within `known` or to one limit in force (at
      -- 2/s, 1.9 held and 2.0 failed: no limit lies between to try, and
      -- the 5% between them was over `known`): it is taken as halfway
      -- between the rate that held and the probe that failed, as the
      -- upstream saw them (the limits in force: at 2/s, 1.9 held and 2.0
      -- failed, where the rates were 1.9 and 1.98 and halfway between
      -- them put 1.8 in force), the rate goes back to just under it, and
      -- it is probed rarely.
      ceiling = (inForce(held) + inForce(failed)) / 2
      probeAt = now + math.max(plateau, plateauCalls * period / held)
      r = near * ceiling
    end
  end
  r = clamp(r)
  cut, sinceCut, sinceBusy, sinceFresh, busyFresh, k, held = now, 0, 0, 0, 0, 0, 0
  cause = 'slow down'
  if busy == 0 then cause = 'allowance low' end
-- A raise needs a second with no "slow down" from any worker: one
-- worker's report with none, a second after a cut, raised a rate that the
-- 429s in the others' reports since (counted by that cut) said was too
-- high (2.4 to 2.5/s at 2/s, 2026-12-07).
elseif ok > 0 and busy == 0 and now - at >= second and now - cut >= second and now - lastBusy >= second and recent + period / second >= busyEnough * r then
  if ceiling <= 0 then
    r = r * growth
  elseif r < 0.999 * near * ceiling then -- (r is kept to 6 decimals)
    r = math.min(near * ceiling, r + math.max((near * ceiling - r) / 2, 0.01 * ceiling))
    -- In tenths, the last steps of the approach change no limit in force:
    -- taken at once. (In whole events the approach stays gradual: taken
    -- at once there, jobs' TestAdaptController used 49.0/s of 50 in its
    -- last phase, not 49.8, and its fall's 429s went on 1.23 s, not 0.99.)
    if quantum(r) < 1 and inForce(r) == inForce(near * ceiling) then r = near * ceiling end
  elseif now >= statedUntil and now >= probeAt and now - at >= probeCalls * period / r then
    -- (A step waits probeCalls calls' time at the rate it leaves: at 2/s a
    -- second is two calls, too few to say the rate held.)
    if failed > 0 and failed - r < known * r then
      -- This rate held within `known` of the probe that failed: the bound
      -- is spent, and probes go as before (a limit that rose is found as
      -- fast; one that did not fails again, and is known at that cut),
      -- from their first step: the steps of the narrowed search are not
      -- carried on (a step of 8 or 16% of the ceiling just under a rate
      -- that failed).
      failed, k = 0, 0
    end
    local step = math.min(0.04 * ceiling * 2 ^ k, ceiling)
    if failed > 0 then
      step = math.min(step, (failed - r) / 2) -- halfway to the probe that failed
    end
    -- A step puts the next limit up in force at least: one that rounds
    -- back to the limit in force would be said to hold untested.
    r = math.max(r + step, inForce(r) + 0.6 * quantum(r))
    k = k + 1
  end
  r = clamp(r)
  if r ~= before then cause, held = 'successes', before end
end
if cause ~= '' then at = now end
if busy > 0 or low then lastBusy = now end
local rounded = inForce(r)
if rounded ~= limit then limit, limitAt = rounded, now end
local function num(x)
  if x == math.floor(x) then return int(x) end
  return string.format('%.1f', x)
end

redis.call('HSET', key, 'r', string.format('%.6f', r), 'c', string.format('%.6f', ceiling), 'at', int(at), 'cut', int(cut),
  'sc', int(sinceCut), 'sf', int(sinceFresh), 'bf', int(busyFresh), 'sb', int(sinceBusy), 'pr', string.format('%.6f', held), 'pa', int(probeAt), 'fp', string.format('%.6f', failed), 'k', int(k), 'w', int(w), 's', int(s), 'sp', int(sp), 'st', int(statedUntil),
  'l', num(limit), 'g', int(limitAt), 'lb', int(lastBusy))
redis.call('EXPIRE', key, ttl)
return {string.format('%.6f', r), string.format('%.6f', before), cause, string.format('%.6f', recent), num(limit), int(limitAt),
  string.format('%.6f', ceiling)}
