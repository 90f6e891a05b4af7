-- allow_window: a fixed window's AllowN or ReserveN (as allow_limit.lua's), with
-- the fewest keys and arguments, and a quick decision on the states most
-- calls find: none, or "0,i,c" (no block, events in one window, the
-- current one). Any other state goes to new_counter (allow_limit).
--
-- KEYS[1] -> the state key (its aux key, unused, is KEYS[1] .. ':b')
-- ARGV[1] -> now in µs, or '' to read Redis TIME
-- ARGV[2] -> period (µs)
-- ARGV[3] -> limit - n: the most a window may hold before the n
-- ARGV[4] -> n
-- ARGV[5] -> TTL slack (µs), added to every TTL
-- ARGV[6] -> the longest wait (µs); 0 counts now or never
-- ARGV[7] -> not before (µs)
--            (ARGV[5..7] left out from the first on that all are 0)
-- Output  -> allow_limit's; a booking's from the quick decision is {1, now,
--            at, remaining, reset_after}: no retry_after (0), and pieces,
--            the instant at, formatted by algorithms

local now = clock()
local period, most, n = ARGV[2] + 0, ARGV[3] + 0, ARGV[4] + 0
local slack, max_wait, start = lean_options(5, now)

local function slow()
  local p = {limit = most + n, period = period, burst = most + n, windows = 1, n = n, member = ''}
  return allow_limit(new_counter(KEYS[1], KEYS[1] .. ':b', p), now, start, max_wait, slack)
end

local key = KEYS[1]
local state = redis.call('GET', key)
local head, i, c = nil, 0, 0 -- the window with events, its index and count (c 0: none)
local current = floordiv(now, period)
if state then
  local index, count
  head, index, count = string.match(state, '^(0,(%-?%d+),)(%d+)$')
  if not head then return slow() end
  i, c = index + 0, count + 0
  if i < current then -- trimmed: gone
    head, i, c = nil, 0, 0
  elseif i > current then -- booked ahead
    return slow()
  end
end

local at, k = start, floordiv(start, period)
if c > 0 and k == i and c > most and start - now <= max_wait then
  k = k + 1
  at = k * period
end
if at - now > max_wait then
  local left, reset = 0, 0
  if c > 0 then
    reset = (i + 1) * period - now
    if start == now then left = most + n - c end
  elseif start == now then
    left = most + n
  end
  if state and c == 0 then -- as new_counter's save of what trimming emptied
    redis.call('SET', key, '0', 'PX', string.format('%d', math.max(1, ceildiv(slack, 1000))))
  end
  if left < 0 then left = 0 end
  return {0, now, at, left, at - now, math.max(start - now, reset), ''}
end
if c > 0 and k ~= i then return slow() end -- two windows
c = c + n
local ttl = string.format('%d', ceildiv((k + 1) * period - now + slack, 1000))
if head then
  redis.call('PSETEX', key, ttl, head .. string.format('%d', c))
else
  redis.call('PSETEX', key, ttl, string.format('0,%d,', k) .. ARGV[4])
end
local left = most + n - c
if left < 0 then left = 0 end
return {1, now, at, left, (k + 1) * period - now}
