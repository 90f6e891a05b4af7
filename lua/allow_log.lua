-- allow_log: a sliding log's AllowN or ReserveN (as allow_limit.lua's), with the
-- fewest arguments: sliding_log_allow's quick decision, new_sliding_log
-- (allow_limit) for a log with events after the instant booked.
--
-- KEYS[1], KEYS[2] -> the log and its block (see sliding_log.lua)
-- ARGV[1] -> now in µs, or '' to read Redis TIME
-- ARGV[2..4] -> limit, period (µs), n
-- ARGV[5] -> TTL slack (µs), added to every TTL
-- ARGV[6] -> the longest wait (µs); 0 counts now or never
-- ARGV[7] -> not before (µs)
--            (ARGV[5..7] left out from the first on that all are 0)
-- Output  -> allow_limit's, or sliding_log_allow's

local now = clock()
local limit, period, n = ARGV[2] + 0, ARGV[3] + 0, ARGV[4] + 0
local slack, max_wait, start = lean_options(5, now)
local reply = sliding_log_allow(KEYS[1], KEYS[2], limit, period, n, now, start, max_wait, slack, ARGV[1])
if reply then return reply end
local p = {limit = limit, period = period, burst = limit, windows = 1, n = n, member = ''}
return allow_limit(new_sliding_log(KEYS[1], KEYS[2], p), now, start, max_wait, slack)
