-- allow_bucket: a token or leaky bucket's AllowN or ReserveN (as
-- allow_limit.lua's), with the fewest keys and arguments and no number the call
-- does not need: Go sends the bucket's units already reduced.
--
-- KEYS[1] -> the state key (its aux key is KEYS[1] .. ':b', in its slot)
-- ARGV[1] -> now in µs, or '' to read Redis TIME
-- ARGV[2] -> period/g, g = gcd(limit, period)
-- ARGV[3], ARGV[4] -> burst and n in units of 1/(limit/g) µs (times
--            period/g)
-- ARGV[5] -> TTL slack (µs), added to every TTL
-- ARGV[6] -> the longest wait (µs); 0 counts now or never
-- ARGV[7] -> not before (µs)
-- ARGV[8] -> limit/g
--            (ARGV[5..8] left out from the first on that all are 0, or 1
--            for limit/g: AllowN on Redis's clock sends four)
-- Output  -> allow_limit's, or bucket_quick's

local now = clock()
local per_event, window, need = ARGV[2] + 0, ARGV[3] + 0, ARGV[4] + 0
local slack, max_wait, start, per_micro = 0, 0, now, 1
if ARGV[5] then
  slack = ARGV[5] + 0
  if ARGV[6] then
    max_wait = ARGV[6] + 0
    if ARGV[7] then
      if ARGV[7] + 0 > now then start = ARGV[7] + 0 end
      if ARGV[8] then per_micro = ARGV[8] + 0 end
    end
  end
end
-- ARGV[1] and ARGV[4] are the state an empty bucket is left with when it
-- is booked at now, written as they came.
local reply = bucket_quick(KEYS[1], now, per_micro, per_event, window, need, start, max_wait, slack, ARGV[1], ARGV[4])
if reply then return reply end
-- limit/g and period/g have no common divisor: new_bucket's units are the same.
local p = {limit = per_micro, period = per_event, burst = window / per_event, windows = 1, n = need / per_event, member = ''}
return allow_limit(new_bucket(KEYS[1], KEYS[1] .. ':b', p), now, start, max_wait, slack)
