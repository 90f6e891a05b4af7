-- The sliding counter's lean script (lua.Allow["sliding_counter"]) as of
-- commit 5e0f030, the last version that wrote the text form "b,i1,c1,...":
-- TestSlidingCounterStateOfEarlierVersions writes states with it.
-- Common to every sluice script (lua.go puts it in front of each one).
-- The scripts need Redis 6.0 or later (SET ... KEEPTTL; effects
-- replication, the default since 5.0, lets them write after reading TIME).
--
-- The hot paths write a state with PSETEX, SET ... PX with one argument
-- fewer for the server to read.
--
-- All times are integer microseconds. A Unix time in µs is below 2^53, so
-- Lua's doubles hold it, and every product the scripts form, exactly.
-- Redis formats a number passed to redis.call exactly (%.17g), but Lua's
-- own conversion to a string keeps 14 digits: a number that becomes part
-- of a string goes through int(), or string.format's %d (64 bits), which
-- formats several at once.

local function int(x)
  return string.format('%.0f', x)
end

-- floordiv and ceildiv divide an integer by a positive integer exactly
-- (a may be negative). Lua 5.1's a % b is a - floor(a / b) * b, and a / b
-- is rounded, so the remainder may be off by b: it is mended, and then
-- a - r is a multiple of b whose quotient a division gives exactly. (No
-- math.floor: a call of a C function costs more than the rest of this.)
local function floordiv(a, b)
  local r = a % b
  if r < 0 then r = r + b elseif r >= b then r = r - b end
  return (a - r) / b
end

local function ceildiv(a, b)
  local r = a % b
  if r < 0 then r = r + b elseif r >= b then r = r - b end
  if r == 0 then return a / b end
  return (a - r) / b + 1
end

-- One assignment at a time: miniredis's Lua (gopher-lua) assigns a before
-- it reads a for b in "a, b = b, a % b", so that gcd(4, 100000) was 100000
-- there (a bucket's every event then took 1/25,000 of its time).
local function gcd(a, b)
  while b ~= 0 do
    local r = a - floordiv(a, b) * b
    a = b
    b = r
  end
  return a
end

-- nums returns the integers of a string "a b c ...", as the scripts write
-- their states.
local function nums(s)
  local v = {}
  for x in string.gmatch(s, '%-?%d+') do v[#v + 1] = tonumber(x) end
  return v
end

-- list_nums returns the integers of a state written by list_text, "a,b,c"
-- (a JSON array's inside, which cjson reads in C: about a third of nums'
-- instructions), or of one written as nums reads it, as states were before.
local function list_nums(s)
  if string.find(s, ' ', 1, true) then return nums(s) end
  return cjson.decode('[' .. s .. ']')
end

-- ARGV[1] is the caller's clock when one was injected, '' otherwise: then
-- Redis's own clock decides, so that no two workers disagree about time.
-- (Lua reads a string in arithmetic as the number it holds, exactly:
-- cheaper than tonumber, a call of a C function.)
local function clock()
  if ARGV[1] ~= '' then return ARGV[1] + 0 end
  local t = redis.call('TIME')
  return t[1] * 1000000 + t[2]
end

-- A key's recent throttles ("recent"): a ring "b c b c ..." of how many
-- events were throttled in each RECENT_STEP of time (b: now // step), the
-- last RECENT_STEPS steps kept, so that the last minute is in it whatever
-- the phase. Readers (throttle.RecentThrottled) sum the steps that overlap
-- the last minute.
local RECENT_STEP = 10000000 -- µs
local RECENT_STEPS = 7
local RECENT_LIFE = RECENT_STEP * RECENT_STEPS / 1000 -- ms

-- recent_add returns ring (nil: empty) with n more throttled at now, the
-- steps too old to matter dropped.
local function recent_add(ring, now, n)
  local b = floordiv(now, RECENT_STEP)
  local out, added = {}, false
  if ring then
    local v = nums(ring)
    for i = 1, #v - 1, 2 do
      if v[i] > b - RECENT_STEPS then
        local c = v[i + 1]
        if v[i] == b then c, added = c + n, true end
        out[#out + 1] = string.format('%d %d', v[i], c)
      end
    end
  end
  if not added then out[#out + 1] = string.format('%d %d', b, n) end
  return table.concat(out, ' ')
end

-- recent_note counts n events throttled at now in the ring kept at key (a
-- string), which lives as long as the ring matters.
local function recent_note(key, now, n)
  redis.call('SET', key, recent_add(redis.call('GET', key), now, n), 'PX', RECENT_LIFE)
end

-- recent_note_in counts n events throttled at now for field, in the hash
-- at key that keeps the rings of many key values (one slot's): at most
-- RECENT_FIELDS of them. Once per RECENT_LIFE the rings of fields quiet
-- that long are swept out; a new field that finds the hash full is not
-- counted.
local RECENT_FIELDS = 10000
local RECENT_SWEPT = '%swept' -- no escaped key value is this (keys.go)
local function recent_note_in(key, field, now, n)
  local ring = redis.call('HGET', key, field)
  if not ring then
    local swept = tonumber(redis.call('HGET', key, RECENT_SWEPT) or 0)
    if now - swept > RECENT_LIFE * 1000 then
      local all = redis.call('HGETALL', key)
      local oldest = floordiv(now, RECENT_STEP) - RECENT_STEPS
      for i = 1, #all - 1, 2 do
        if all[i] ~= RECENT_SWEPT then
          local v = nums(all[i + 1])
          if (v[#v - 1] or oldest) <= oldest then redis.call('HDEL', key, all[i]) end
        end
      end
      redis.call('HSET', key, RECENT_SWEPT, int(now))
    end
    if redis.call('HLEN', key) > RECENT_FIELDS then return end
  end
  redis.call('HSET', key, field, recent_add(ring, now, n))
  redis.call('PEXPIRE', key, RECENT_LIFE)
end

-- counter: fixed_window (windows 1) and sliding_counter. Events are counted
-- per sub-window of period / windows; events at an instant fall in every
-- run of `windows` consecutive sub-windows that holds that instant's, and
-- each run holds at most limit. Mirrors CounterState in
-- algorithms/counter.go.
--
-- state -> string "b,i1,c1,i2,c2,...": µs until which the key is blocked
--          (0: not), then each sub-window with events: its index
--          (time µs // (period / windows)) and its events, by index (read
--          with spaces for commas too, as versions before wrote it; they
--          read commas alike)
-- aux   -> unused

local function new_counter(key, _, p)
  local sub, windows, n = p.period / p.windows, p.windows, p.n
  local self = {blocked = 0}
  local counts = {}
  local state = redis.call('GET', key)
  if state then
    local v = list_nums(state)
    self.blocked = v[1]
    for i = 2, #v - 1, 2 do counts[v[i]] = v[i + 1] end
  end

  local function count(i) return counts[i] or 0 end

  function self.trim(now)
    local oldest = floordiv(now, sub) - windows
    for i in pairs(counts) do
      if i <= oldest then counts[i] = nil end
    end
  end

  -- runs returns the largest total of a run of `windows` sub-windows that
  -- holds sub-window i, and the last run (by its last sub-window) whose
  -- total is above most, or i - 1 if none is.
  local function runs(i, most)
    local total = 0
    for k = i - windows + 1, i do total = total + count(k) end
    local largest, last_over = total, i - 1
    for j = i, i + windows - 1 do
      if total > most then last_over = j end
      if total > largest then largest = total end
      total = total + count(j + 1) - count(j + 1 - windows)
    end
    return largest, last_over
  end

  function self.earliest(at)
    local i = floordiv(at, sub)
    while true do
      local _, over = runs(i, p.limit - n)
      if over < i then return math.max(at, i * sub) end
      i = over + 1 -- every run up to over must be left behind
    end
  end

  function self.record(at)
    local i = floordiv(at, sub)
    counts[i] = count(i) + n
    return int(at)
  end

  function self.give_back(pieces)
    local at = tonumber(pieces)
    if not at then return end
    local i = floordiv(at, sub)
    if counts[i] then
      counts[i] = counts[i] - n
      if counts[i] <= 0 then counts[i] = nil end
    end
  end

  function self.room(at)
    local largest = runs(floordiv(at, sub), p.limit)
    return math.max(0, p.limit - largest)
  end

  function self.reset_after(at)
    local latest = nil
    for i in pairs(counts) do
      if not latest or i > latest then latest = i end
    end
    if not latest then return 0 end
    return math.max(0, (latest + windows) * sub - at)
  end

  function self.block(until_)
    self.blocked = until_
  end

  function self.empty() return next(counts) == nil end

  -- used: the sub-windows up to now's, each at its last µs (now's at now).
  function self.used(now)
    local events, current = {}, floordiv(now, sub)
    for i, c in pairs(counts) do
      if i <= current then events[#events + 1] = {math.min(now, (i + 1) * sub - 1), c} end
    end
    return {events = events}
  end

  function self.seed(_, used)
    for _, e in ipairs(used.events) do
      local i = floordiv(e[1], sub)
      counts[i] = count(i) + e[2]
    end
  end

  -- save writes the state, trimmed or not: the Go twin keeps what this
  -- keeps, also when a clock steps back.
  function self.save(ttl)
    local indexes = {}
    for i in pairs(counts) do indexes[#indexes + 1] = i end
    table.sort(indexes)
    local parts = {string.format('%d', self.blocked)}
    for _, i in ipairs(indexes) do
      parts[#parts + 1] = string.format('%d,%d', i, counts[i])
    end
    redis.call('SET', key, table.concat(parts, ','), 'PX', ttl)
  end

  return self
end

-- allow_limit: the decision of one limit's AllowN or ReserveN on g, a
-- limit its algorithm's constructor built: book.lua's book of one claim
-- with no ID, nothing to give back, no replaced limit, no recent throttles
-- and no remind. start is the earliest instant (not before, or now),
-- max_wait the longest wait (µs; 0 counts now or never), slack what is
-- added to every TTL (µs). It returns book.lua's output for one claim:
-- {ok (1: booked, 0: not), now, at, remaining, retry_after, reset_after,
-- pieces}.
local function allow_limit(g, now, start, max_wait, slack)
  g.trim(now)

  -- As book.lua's save.
  local function save()
    local life = math.max(g.reset_after(now), g.blocked - now, 0)
    g.save(math.max(1, ceildiv(life + slack, 1000)))
  end

  local from = math.max(start, g.blocked)
  local at = from
  if from - now <= max_wait then at = g.earliest(from) end
  if at - now > max_wait then
    local room = 0
    if from == now then room = g.room(now) end
    local reply = {0, now, at, room, at - now, math.max(from - now, g.reset_after(now)), ''}
    save() -- what trimming changed
    return reply
  end
  local pieces = g.record(at)
  local reply = {1, now, at, g.room(at), 0, at - now + g.reset_after(at), pieces}
  save()
  return reply
end

-- lean_options reads the lean scripts' last arguments from ARGV[i] on:
-- TTL slack (µs), the longest wait (µs) and not before (µs), each left
-- out, with those after it, where all are 0. It returns slack, max_wait
-- and start (the later of not before and now).
local function lean_options(i, now)
  local slack, max_wait, start = 0, 0, now
  if ARGV[i] then
    slack = ARGV[i] + 0
    if ARGV[i + 1] then
      max_wait = ARGV[i + 1] + 0
      if ARGV[i + 2] and ARGV[i + 2] + 0 > now then start = ARGV[i + 2] + 0 end
    end
  end
  return slack, max_wait, start
end

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

