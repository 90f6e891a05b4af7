-- allow_counter: a sliding counter's AllowN or ReserveN (as allow_limit.lua's),
-- with the fewest keys and arguments, and a quick decision on the states
-- most calls find: none, or no block and the events booked in or after
-- the last sub-window with events. It writes the state back as it read
-- it, less the sub-windows trimmed, with the last count changed or one
-- appended, where new_counter's save formats every count. Any other state
-- goes to new_counter (allow_limit).
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
  return allow_limit(new_counter(KEYS[1], KEYS[1] .. ':b', p), now, start, max_wait, slack)
end

local key = KEYS[1]
local state = redis.call('GET', key)
local first, last = 1, nil -- first: the state's first kept pair; last: the last index
local v
if state then
  if string.sub(state, 1, 2) ~= '0,' and state ~= '0' then return slow() end
  v = cjson.decode('[' .. state .. ']')
  local oldest = floordiv(now, sub) - windows
  for j = 2, #v - 1, 2 do
    if v[j] > oldest then break end
    first = j + 2
  end
  if first < #v then last = v[#v - 1] end
end

-- kept returns the state as read, less the pairs trimmed.
local function kept()
  if not last then return '0' end
  local from = 3 -- after "0,"
  for _ = 2, first - 1 do from = string.find(state, ',', from, true) + 1 end
  return '0,' .. string.sub(state, from)
end

-- save writes the state as read, less the pairs trimmed, with n more in
-- sub-window k (the last or after it), and returns its reset_after.
local function save(k, count)
  local out = kept()
  if k == last then
    out = string.match(out, '^(.*,)') .. string.format('%d', count)
  else
    out = out .. string.format(',%d,', k) .. ARGV[5]
  end
  local reset = (k + windows) * sub - now
  redis.call('PSETEX', key, string.format('%d', ceildiv(reset + slack, 1000)), out)
  return reset
end

-- The quick decision most calls find: nothing counted after start's
-- sub-window, so the windows that hold it count no more than the one that
-- ends there, and there is room in that one. (Else the general search.)
local i = floordiv(start, sub)
if start - now <= max_wait and (not last or last <= i) then
  local total = 0
  if last then
    for j = #v - 1, first, -2 do
      if v[j] <= i - windows then break end
      total = total + v[j + 1]
    end
  end
  if total + n <= limit then
    local count = n
    if i == last then count = v[#v] + n end
    return {1, now, start, limit - total - n, save(i, count)}
  end
end

local counts = {}
if v then
  for j = math.max(first, 2), #v - 1, 2 do counts[v[j]] = v[j + 1] end
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
  if first > 2 then -- as new_counter's save of what trimming changed
    redis.call('SET', key, kept(), 'PX', string.format('%d', math.max(1, ceildiv(reset + slack, 1000))))
  end
  return {0, now, at, left, at - now, math.max(start - now, reset), ''}
end
local k = floordiv(at, sub)
if last and k < last then return slow() end -- booked before the last sub-window
counts[k] = (counts[k] or 0) + n
local reset = save(k, counts[k])
return {1, now, at, math.max(0, limit - runs(k, limit)), reset}
