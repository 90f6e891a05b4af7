-- allow_counter: a sliding counter's AllowN or ReserveN (as allow_limit.lua's),
-- with the fewest keys and arguments, and a quick decision on the states
-- most calls find: none, or one in the cumulative form (counter.lua) not
-- blocked past start, with no events after start's sub-window. It reads
-- only the numbers the decision needs (the block, the sub-windows trimmed,
-- the first kept and the last: the events of a run of sub-windows are the
-- difference of two running totals), and writes the state back as it read
-- it, less the sub-windows trimmed, with the last total changed or one
-- sub-window appended. A call that must wait or is refused reads every
-- kept sub-window. Any other state (the text form of earlier versions, a
-- block, events booked before the last sub-window, or no struct library)
-- goes to new_sliding_counter (allow_limit), which writes the cumulative
-- form where it can.
--
-- KEYS[1] -> the state key (its aux key, unused, is KEYS[1] .. ':b')
-- ARGV[1] -> now in µs, or '' to read Redis TIME
-- ARGV[2..5] -> period / windows (µs), windows, limit, n
-- ARGV[6] -> TTL slack (µs), added to every TTL
-- ARGV[7] -> the longest wait (µs); 0 counts now or never
-- ARGV[8] -> not before (µs)
--            (ARGV[6..8] left out from the first on that all are 0)
-- Output  -> allow_limit's; a booking's from the quick decision is {1, now,
--            at, remaining, reset_after}: no retry_after (0), and pieces,
--            the instant at, formatted by algorithms

local now = clock()
local sub, windows, limit, n = ARGV[2] + 0, ARGV[3] + 0, ARGV[4] + 0, ARGV[5] + 0
local slack, max_wait, start = lean_options(6, now)

local function slow()
  local p = {limit = limit, period = sub * windows, burst = limit, windows = windows, n = n, member = ''}
  return allow_limit(new_sliding_counter(KEYS[1], KEYS[1] .. ':b', p), now, start, max_wait, slack)
end

local key = KEYS[1]
local state = redis.call('GET', key)
-- The cumulative form's numbers at byte pos and after: b, base, then pairs
-- (index, running total) of 16 bytes from byte 18 on.
local size, b, base, j, t = 0, 0, 0, nil, nil -- j, t: the pair at pos
if state then
  if state < ':' then return slow() end -- the text form
  size = #state
  if size == 17 then
    b, base = struct.unpack('<dd', state, 2)
  else
    b, base, j, t = struct.unpack('<dddd', state, 2)
  end
  if b > start then return slow() end
elseif not rawget(_G, 'struct') then -- (a global that is not there is an error)
  return slow() -- miniredis, whose Lua has no struct: the text form
end

-- Trimmed: the sub-windows that slid out by now. kept is the byte of the
-- first pair kept, kept_base the running total before it.
local pos = 18
local oldest = floordiv(now, sub) - windows
while j and j <= oldest do
  base, pos = t, pos + 16
  if pos < size then j, t = struct.unpack('<dd', state, pos) else j = nil end
end
local kept, kept_base = pos, base
-- The last sub-window with events (nil: none kept), and the total up to it.
local last, top = nil, base
if j then
  if pos + 16 > size then last, top = j, t else last, top = struct.unpack('<dd', state, size - 15) end
end

-- write saves the state as read, less the pairs trimmed, with sub-window
-- k (the last or after it) at running total total, and returns its
-- reset_after.
local function write(k, total)
  local out
  if k == last and kept == 18 then
    out = string.sub(state, 1, -9) .. struct.pack('<d', total)
  elseif k == last then
    out = COUNTER_CUMULATIVE .. struct.pack('<dd', b, kept_base) .. string.sub(state, kept, -9) .. struct.pack('<d', total)
  elseif state and kept == 18 then
    out = state .. struct.pack('<dd', k, total)
  elseif state then
    out = COUNTER_CUMULATIVE .. struct.pack('<dd', b, kept_base) .. string.sub(state, kept) .. struct.pack('<dd', k, total)
  else
    out = COUNTER_CUMULATIVE .. struct.pack('<dddd', 0, 0, k, total)
  end
  local reset = (k + windows) * sub - now
  redis.call('PSETEX', key, string.format('%d', ceildiv(reset + slack, 1000)), out)
  return reset
end

-- The quick decision most calls find: nothing counted after start's
-- sub-window i, so the windows that hold it count no more than the one that
-- ends there (the running total at the last less the one before that
-- window), and there is room in that one. (Else the general search.)
local i = floordiv(start, sub)
if start - now <= max_wait and (not last or last <= i) then
  local before = base -- the running total before sub-window i - windows + 1
  while j and j <= i - windows do
    before, pos = t, pos + 16
    if pos < size then j, t = struct.unpack('<dd', state, pos) else j = nil end
  end
  local total = top - before
  if total + n <= limit then
    return {1, now, start, limit - total - n, write(i, top + n)}
  end
end

-- The general search (as new_counter's), on the kept sub-windows' counts.
local counts = {}
if last then
  local v, prev = counter_cumulative_nums(state, kept), kept_base
  for x = 1, #v - 1, 2 do
    counts[v[x]] = v[x + 1] - prev
    prev = v[x + 1]
  end
end

-- As new_counter's runs.
local function runs(i, most)
  local total = 0
  for k = i - windows + 1, i do total = total + (counts[k] or 0) end
  local largest, last_over = total, i - 1
  for j = i, i + windows - 1 do
    if total > most then last_over = j end
    if total > largest then largest = total end
    total = total + (counts[j + 1] or 0) - (counts[j + 1 - windows] or 0)
  end
  return largest, last_over
end

local at = start
if start - now <= max_wait then
  local w = i -- the first sub-window the events may go in
  while true do
    local _, over = runs(w, limit - n)
    if over < w then
      at = math.max(start, w * sub)
      break
    end
    w = over + 1
  end
end
if at - now > max_wait then
  local left, reset = 0, 0
  if start == now then left = math.max(0, limit - runs(floordiv(now, sub), limit)) end
  if last then reset = math.max(0, (last + windows) * sub - now) end
  if kept > 18 then -- as new_counter's save of what trimming changed
    redis.call('SET', key, COUNTER_CUMULATIVE .. struct.pack('<dd', b, kept_base) .. string.sub(state, kept), 'PX',
      string.format('%d', math.max(1, ceildiv(reset + slack, 1000))))
  end
  return {0, now, at, left, at - now, math.max(start - now, reset), ''}
end
local k = floordiv(at, sub)
if last and k < last then return slow() end -- booked before the last sub-window
counts[k] = (counts[k] or 0) + n
local reset = write(k, top + n)
return {1, now, at, math.max(0, limit - runs(k, limit)), reset}
