-- counter: fixed_window (windows 1) and sliding_counter. Events are counted
-- per sub-window of period / windows; events at an instant fall in every
-- run of `windows` consecutive sub-windows that holds that instant's, and
-- each run holds at most limit. Mirrors CounterState in
-- algorithms/counter.go.
--
-- state -> a fixed window's, and a sliding counter's where Lua has no
--          struct library (miniredis): string "b,i1,c1,i2,c2,...": µs
--          until which the key is blocked (0: not), then each sub-window
--          with events: its index (time µs // (period / windows)) and its
--          events, by index (read with spaces for commas too, as versions
--          before wrote it; they read commas alike)
--          a sliding counter's (the cumulative form): COUNTER_CUMULATIVE,
--          then doubles (struct '<d', exact below 2^53): b, a running total
--          base, then each sub-window with events, by index: its index and
--          the running total up to and including it (its events: that less
--          the total before it, base for the first). struct.unpack reads
--          the numbers a decision needs in one call each, at fixed offsets
--          from either end (cjson's parse of the text form was a quarter of
--          a decision); earlier versions read only the text form (see
--          docs/throttle.md on upgrading).
-- aux   -> unused

-- COUNTER_CUMULATIVE starts the cumulative form: above '9', where the
-- text form starts with a digit or '-', so that `state >= ':'` tells them
-- apart without a call of a C function.
local COUNTER_CUMULATIVE = 'c'

-- counter_cumulative_nums returns the numbers of a state in the cumulative
-- form from byte pos on (2: all of them), in chunks: struct.unpack returns
-- its numbers on Lua's stack, which holds some thousands.
local function counter_cumulative_nums(state, pos)
  local v, left = {}, (#state + 1 - pos) / 8
  while left > 0 do
    local k = left
    if k > 512 then k = 512 end
    local chunk = {struct.unpack('<' .. string.rep('d', k), state, pos)}
    for j = 1, k do v[#v + 1] = chunk[j] end
    pos, left = chunk[k + 1], left - k
  end
  return v
end

-- new_counter builds a counter on key; cumulative: it writes the
-- cumulative form (it reads both).
local function new_counter(key, _, p, cumulative)
  local sub, windows, n = p.period / p.windows, p.windows, p.n
  local self = {blocked = 0}
  local counts = {}
  local state = redis.call('GET', key)
  if state and state >= ':' then
    local v = counter_cumulative_nums(state, 2)
    self.blocked = v[1]
    for i = 3, #v - 1, 2 do counts[v[i]] = v[i + 1] - v[i - 1] end
  elseif state then
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
    if cumulative then
      local parts, total = {COUNTER_CUMULATIVE, struct.pack('<dd', self.blocked, 0)}, 0
      for _, i in ipairs(indexes) do
        total = total + counts[i]
        parts[#parts + 1] = struct.pack('<dd', i, total)
      end
      redis.call('SET', key, table.concat(parts), 'PX', ttl)
      return
    end
    local parts = {string.format('%d', self.blocked)}
    for _, i in ipairs(indexes) do
      parts[#parts + 1] = string.format('%d,%d', i, counts[i])
    end
    redis.call('SET', key, table.concat(parts, ','), 'PX', ttl)
  end

  return self
end

-- new_sliding_counter builds a sliding counter on key: new_counter, which
-- writes the cumulative form where Lua has struct (Redis; not miniredis,
-- where reading a global that is not there is an error, as on Redis).
local function new_sliding_counter(key, aux, p)
  return new_counter(key, aux, p, rawget(_G, 'struct') ~= nil)
end
