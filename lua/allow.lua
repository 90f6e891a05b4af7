-- allow: one limit's AllowN or ReserveN with the fewest keys and
-- arguments (allow_limit.lua), for the windowed algorithms (the buckets
-- have allow_bucket.lua). lua.go puts it after the one constructor it
-- needs, new_limit, and the algorithm's quick decision, fast_limit or nil
-- (as a script), or passes it both (as a function).
--
-- KEYS[1], KEYS[2] -> the state and aux keys (see the algorithm)
-- ARGV[1] -> now in µs, or '' to read Redis TIME
-- ARGV[2..7] -> algorithm, limit, period, burst, windows, n
-- ARGV[8] -> not before (µs)
-- ARGV[9] -> the longest wait (µs); 0 counts now or never
-- ARGV[10] -> TTL slack (µs), added to every TTL
-- Output  -> allow_limit's

local now = clock()
local p = {limit = tonumber(ARGV[3]), period = tonumber(ARGV[4]), burst = tonumber(ARGV[5]),
  windows = tonumber(ARGV[6]), n = tonumber(ARGV[7]), member = ''}
local start, max_wait, slack = math.max(now, tonumber(ARGV[8])), tonumber(ARGV[9]), tonumber(ARGV[10])
-- The algorithm's quick decision for the states most calls find, if it
-- has one (fast_limit, or nil).
if fast_limit then
  local reply = fast_limit(KEYS[1], KEYS[2], p, now, start, max_wait, slack)
  if reply then return reply end
end
return allow_limit(new_limit(KEYS[1], KEYS[2], p), now, start, max_wait, slack)
