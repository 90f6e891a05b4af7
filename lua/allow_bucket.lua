-- allow_bucket: a token or leaky bucket's AllowN or ReserveN (as
-- allow.lua's), with the fewest keys and arguments and no number the call
-- does not need: Go sends the bucket's units already reduced.
--
-- KEYS[1] -> the state key (its aux key is KEYS[1] .. ':b', in its slot)
-- ARGV[1] -> now in µs, or '' to read Redis TIME
-- ARGV[2], ARGV[3] -> limit/g and period/g, g = gcd(limit, period)
-- ARGV[4], ARGV[5] -> burst, n
-- ARGV[6] -> not before (µs)
-- ARGV[7] -> the longest wait (µs); 0 counts now or never
-- ARGV[8] -> TTL slack (µs), added to every TTL
-- Output  -> allow_limit's

local now = clock()
local per_micro, per_event, burst, n = ARGV[2] + 0, ARGV[3] + 0, ARGV[4] + 0, ARGV[5] + 0
local start, max_wait, slack = ARGV[6] + 0, ARGV[7] + 0, ARGV[8] + 0
if start < now then start = now end
local reply = bucket_quick(KEYS[1], now, per_micro, per_event, burst * per_event, n * per_event, start, max_wait, slack)
if reply then return reply end
-- limit/g and period/g have no common divisor: new_bucket's units are the same.
local p = {limit = per_micro, period = per_event, burst = burst, windows = 1, n = n, member = ''}
return allow_limit(new_bucket(KEYS[1], KEYS[1] .. ':b', p), now, start, max_wait, slack)
