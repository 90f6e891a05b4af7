-- sliding_log: at most limit events in any interval (t - period, t]. An
-- event at x falls in every window (y - period, y] with y in
-- [x, x + period): n events fit at x if none of those windows is full.
-- Mirrors SlidingLogState in algorithms/sliding_log.go.
--
-- state -> sorted set of counted events, scored by their time in µs; each
--          event is its own member ("time:seq"), so n events are n members
-- aux   -> string: µs until which the key is blocked (absent: not)

-- log_add records n events at the instant at_text (µs, as text) in the log
-- at key. NX makes a member
-- that exists already fail to add; the next seq is tried, so n events
-- always become n members. size is the log's ZCARD if the caller knows
-- it (nil: asked).
local function log_add(key, at_text, n, size)
  local seq, added = size or redis.call('ZCARD', key), 0
  if n == 1 then -- most calls: no table of arguments to build and unpack
    added = redis.call('ZADD', key, 'NX', at_text, at_text .. ':' .. (seq + 1))
    seq = seq + 1
  end
  while added < n do
    local args = {}
    for _ = 1, math.min(n - added, 100) do
      seq = seq + 1
      args[#args + 1] = at_text
      args[#args + 1] = at_text .. ':' .. seq
    end
    added = added + redis.call('ZADD', key, 'NX', unpack(args))
  end
end

local function new_sliding_log(key, block_key, p)
  local period, n = p.period, p.n
  local self = {blocked = tonumber(redis.call('GET', block_key)) or 0}
  local newest_known, newest = false, nil

  -- The newest event's time, or nil.
  local function latest()
    if not newest_known then
      local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
      newest, newest_known = tonumber(last[2]), true
    end
    return newest
  end

  function self.trim(now)
    redis.call('ZREMRANGEBYSCORE', key, '-inf', int(now - period))
  end

  -- events(from) lists the events later than from, oldest first, fetched
  -- in pages as the caller reads on: get(i) is the time of the i-th, nil
  -- past the last.
  local function events(from)
    local times, cursor, seen, done = {}, '(' .. int(from), 0, false
    local function get(i)
      while i > #times and not done do
        local page = redis.call('ZRANGEBYSCORE', key, cursor, '+inf', 'WITHSCORES', 'LIMIT', seen, 128)
        for k = 2, #page, 2 do times[#times + 1] = tonumber(page[k]) end
        if #page < 256 then
          done = true
        else
          -- Next page: from the last time on, past the members of that
          -- time already read (times repeat; members do not).
          local last = times[#times]
          seen = 0
          for k = #times, 1, -1 do
            if times[k] ~= last then break end
            seen = seen + 1
          end
          cursor = int(last)
        end
      end
      return times[i]
    end
    return get
  end

  -- window sweeps the ends y of windows (y - period, y]: the events in the
  -- window are those from lo to hi - 1.
  local function window(y)
    local w = {y = y, get = events(y - period), lo = 1, hi = 1}
    while w.get(w.hi) and w.get(w.hi) <= y do w.hi = w.hi + 1 end
    function w.count() return w.hi - w.lo end
    function w.next_entry() return w.get(w.hi) end
    function w.move_to(to)
      w.y = to
      while w.get(w.hi) and w.get(w.hi) <= to do w.hi = w.hi + 1 end
      while w.lo < w.hi and w.get(w.lo) <= to - period do w.lo = w.lo + 1 end
    end
    function w.next_change()
      local next_ = w.get(w.lo) + period
      local entry = w.next_entry()
      if entry and entry < next_ then next_ = entry end
      return next_
    end
    return w
  end

  function self.earliest(at)
    local most = p.limit - n
    local newest_ = latest()
    if not newest_ or newest_ <= at then
      -- Nothing counted after at: only the window ending at at matters,
      -- and n fit once enough of its oldest events have aged out.
      local count = redis.call('ZCOUNT', key, '(' .. int(at - period), int(at))
      if count <= most then return at end
      local kth = redis.call('ZRANGEBYSCORE', key, '(' .. int(at - period), '+inf', 'WITHSCORES', 'LIMIT', count - most - 1, 1)
      return tonumber(kth[2]) + period
    end
    local x = at
    local w = window(x)
    while true do
      if w.count() > most then
        -- Every window ending from here until enough events have left is
        -- too full: the turn comes after them.
        while w.count() > most do w.move_to(w.next_change()) end
        x = w.y
      else
        local entry = w.next_entry()
        if not entry or entry >= x + period then return x end
        w.move_to(entry)
      end
    end
  end

  function self.record(at)
    log_add(key, int(at), n)
    if not newest or at > newest then newest = at end
    return int(at)
  end

  function self.give_back(pieces)
    local at = tonumber(pieces)
    if not at then return end
    local members = redis.call('ZRANGEBYSCORE', key, int(at), int(at), 'LIMIT', 0, n)
    for i = 1, #members, 100 do
      redis.call('ZREM', key, unpack(members, i, math.min(i + 99, #members)))
    end
    newest_known = false
  end

  function self.room(at)
    local w = window(at)
    local fullest = w.count()
    while true do
      local entry = w.next_entry()
      if not entry or entry >= at + period then return math.max(0, p.limit - fullest) end
      w.move_to(entry)
      if w.count() > fullest then fullest = w.count() end
    end
  end

  function self.reset_after(at)
    local newest_ = latest()
    if not newest_ then return 0 end
    return math.max(0, newest_ + period - at)
  end

  function self.block(until_)
    self.blocked = until_
  end

  function self.empty() return redis.call('ZCARD', key) == 0 end

  -- used: the events up to now.
  function self.used(now)
    local events, page = {}, redis.call('ZRANGEBYSCORE', key, '-inf', int(now), 'WITHSCORES')
    for k = 2, #page, 2 do events[#events + 1] = {tonumber(page[k]), 1} end
    return {events = events}
  end

  -- seed, into an empty log: members "time:seq", seq 1, 2, ...
  function self.seed(_, used)
    local args, seq = {}, 0
    for _, e in ipairs(used.events) do
      for _ = 1, e[2] do
        seq = seq + 1
        args[#args + 1] = int(e[1])
        args[#args + 1] = int(e[1]) .. ':' .. seq
        if #args >= 200 then
          redis.call('ZADD', key, unpack(args))
          args = {}
        end
      end
    end
    if #args > 0 then redis.call('ZADD', key, unpack(args)) end
    newest_known = false
  end

  -- save sets the TTLs: the Go twin forgets the key when this lets it
  -- expire.
  function self.save(ttl)
    redis.call('PEXPIRE', key, ttl)
    if self.blocked > 0 then redis.call('SET', block_key, int(self.blocked), 'PX', ttl) end
  end

  return self
end

-- log_save sets the TTLs of sliding_log_allow's log and block: what the
-- log holds lasts reset µs from now, a block until blocked (0: none).
local function log_save(key, block_key, blocked, reset, now, slack)
  local life = blocked - now
  if reset > life then life = reset end
  if life < 0 then life = 0 end
  local ms = ceildiv(life + slack, 1000)
  if ms < 1 then ms = 1 end
  local ttl = string.format('%d', ms)
  redis.call('PEXPIRE', key, ttl)
  if blocked > 0 then redis.call('SET', block_key, int(blocked), 'PX', ttl) end
end

-- sliding_log_allow is allow_log.lua's decision (limit, period, n, now,
-- start, max_wait, slack; now_text: now as the call's text, or '') for
-- a log with no event after the instant booked: new_sliding_log's trim,
-- earliest, record, room, reset_after and save for that log, without
-- building a log of closures. It returns nil, having written nothing, for
-- any other log (new_sliding_log decides then). Each instant is formatted
-- once (now's not at all where the call sent it): formatting numbers
-- costs the server more than the rest of the decision. A booking's reply
-- is {1, now, at, remaining, reset_after}: no retry_after (0), and
-- pieces, the instant at, formatted by algorithms.
local function sliding_log_allow(key, block_key, limit, period, n, now, start, max_wait, slack, now_text)
  local most = limit - n
  -- No math.max or tonumber here: each is a call of a C function, which
  -- costs the server as much as a dozen steps of the decision.
  local blocked = redis.call('GET', block_key)
  blocked = blocked and blocked + 0 or 0
  local from = start
  if blocked > from then from = blocked end
  if now_text == '' then now_text = string.format('%d', now) end
  local from_text = now_text
  if from ~= now then from_text = string.format('%d', from) end
  local trim = string.format('%d', now - period)
  redis.call('ZREMRANGEBYSCORE', key, '-inf', trim)
  local newest = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')[2]
  local reset_now = 0
  if newest then
    newest = newest + 0
    if newest > from then return nil end
    reset_now = newest + period - now
    if reset_now < 0 then reset_now = 0 end
  end
  -- "(from - period": '-inf' where from is now, for the trim left no event
  -- at or before now - period.
  local from_bound = '-inf'
  if from ~= now then from_bound = string.format('(%d', from - period) end

  local at, count = from, nil
  if from - now <= max_wait then
    -- Events in the window that ends at from: with none after it, the
    -- window ending at from is the fullest of those that hold it. From
    -- now, that is every event left.
    if from == now then
      count = redis.call('ZCARD', key)
    else
      count = redis.call('ZCOUNT', key, from_bound, from_text)
    end
    if count > most then
      local kth = redis.call('ZRANGEBYSCORE', key, from_bound, '+inf', 'WITHSCORES', 'LIMIT', count - most - 1, 1)
      at = kth[2] + period
    end
  end
  if at - now > max_wait then
    local left = 0 -- from now, count was read: from - now is 0, within max_wait
    if from == now and count < limit then left = limit - count end
    local reset = from - now
    if reset_now > reset then reset = reset_now end
    local reply = {0, now, at, left, at - now, reset, ''}
    log_save(key, block_key, blocked, reset_now, now, slack)
    return reply
  end
  local at_text = from_text
  if at ~= from then at_text = string.format('%d', at) end
  -- Booked now, count is every event of the log.
  local size = nil
  if at == now then size = count end
  log_add(key, at_text, n, size)
  if at ~= from then
    count = redis.call('ZCOUNT', key, string.format('(%d', at - period), at_text)
  else
    count = count + n
  end
  log_save(key, block_key, blocked, at + period - now, now, slack)
  local left = 0
  if count < limit then left = limit - count end
  return {1, now, at, left, at - now + period}
end
