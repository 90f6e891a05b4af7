-- bucket: token_bucket and leaky_bucket, which admit the same events: at
-- most burst + limit·T/period in any interval of length T. The state is the
-- server time the counted events take, each period/limit: n events fit at x
-- when n events' time is free within burst·period/limit of x, and they take
-- the first free time from x on. See BucketState in algorithms/buckets.go,
-- which this mirrors.
--
-- Time is counted in units of 1/(limit/g) µs, g = gcd(limit, period), from
-- the instant ref; a span [s, e) is busy server time in those units.
--
-- state -> string "ref b count last [s e]": ref (µs), µs until which the key
--          is blocked (0: not), how many spans there are, where the last one
--          ends, and the span itself when there is one. The quick steps
--          (bucket_read, bucket_write) read and write the form most calls
--          find, "ref 0 1 e s e", as it is, so that every version reads
--          what every other writes
-- aux   -> sorted set of the spans when there are two or more: member
--          "s e", score s

local REBASE_AFTER = 2 ^ 50 -- units: see rebaseAfter in buckets.go

local function new_bucket(key, spans_key, p)
  local g = gcd(p.limit, p.period)
  local per_micro, per_event = p.limit / g, p.period / g
  local window, need_n = p.burst * per_event, p.n * per_event
  local self = {blocked = 0}
  local ref, count, last, inline = 0, 0, 0, nil
  local state = redis.call('GET', key)
  if state then
    -- One match, not nums' gmatch: this parse is on every call's way.
    local r, b, c, l, s, e = string.match(state, '^(%-?%d+) (%-?%d+) (%-?%d+) (%-?%d+) ?(%-?%d*) ?(%-?%d*)$')
    ref, self.blocked, count, last = tonumber(r), tonumber(b), tonumber(c), tonumber(l)
    if count == 1 then inline = {tonumber(s), tonumber(e)} end
  end

  local function member(s) return string.format('%d %d', s[1], s[2]) end
  local function parse(m)
    local v = nums(m)
    return {v[1], v[2]}
  end

  -- replace puts spans new in the place of spans old, at once, so that
  -- every later read sees them. With two or more spans they live in the
  -- sorted set; one lives in the state.
  local function replace(old, new)
    local left = count - #old + #new
    if left <= 1 then
      local keep = new[1]
      if left == 1 and not keep then
        -- The one left is the span that old does not name.
        if count == 1 then
          keep = inline
        else
          local gone = {}
          for _, s in ipairs(old) do gone[member(s)] = true end
          for _, m in ipairs(redis.call('ZRANGE', spans_key, 0, -1)) do
            if not gone[m] then keep = parse(m) end
          end
        end
      end
      if count > 1 then redis.call('DEL', spans_key) end
      inline = keep
    else
      local add = {}
      if count == 1 and old[1] ~= inline then
        add[1], add[2] = inline[1], member(inline)
      end
      for _, s in ipairs(new) do
        add[#add + 1], add[#add + 2] = s[1], member(s)
      end
      if #add > 0 then redis.call('ZADD', spans_key, unpack(add)) end
      if count > 1 then
        for _, s in ipairs(old) do redis.call('ZREM', spans_key, member(s)) end
      end
      inline = nil
    end
    count = left
    for _, s in ipairs(new) do
      if s[2] > last then last = s[2] end
    end
  end

  -- spans(x) lists the spans that end after x, in order, fetched in pages
  -- as the caller reads on: get(i) is the i-th, nil past the last. prev is
  -- the span before them if it ends at x exactly (they never touch, so at
  -- most one does).
  local function spans(x)
    local list, done, cursor, prev = {}, false, nil, nil
    if count == 1 then
      if inline[2] > x then list[1] = inline elseif inline[2] == x then prev = inline end
      done = true
    elseif count > 1 then
      local before = redis.call('ZREVRANGEBYSCORE', spans_key, x, '-inf', 'LIMIT', 0, 1)
      if before[1] then
        local s = parse(before[1])
        if s[2] > x then list[1] = s elseif s[2] == x then prev = s end
      end
      cursor = '(' .. int(x)
    else
      done = true
    end
    local function get(i)
      while i > #list and not done do
        local page = redis.call('ZRANGEBYSCORE', spans_key, cursor, '+inf', 'LIMIT', 0, 64)
        for _, m in ipairs(page) do list[#list + 1] = parse(m) end
        if #page < 64 then done = true else cursor = '(' .. int(list[#list][1]) end
      end
      return list[i]
    end
    return get, prev
  end

  local function pos(t) return (t - ref) * per_micro end

  local function busy_in(from, to)
    if count == 0 then return 0 end
    if count == 1 then
      return math.max(0, math.min(inline[2], to) - math.max(inline[1], from))
    end
    local get, busy, i = spans(from), 0, 1
    while get(i) and get(i)[1] < to do
      local s = get(i)
      busy = busy + math.min(s[2], to) - math.max(s[1], from)
      i = i + 1
    end
    return busy
  end

  function self.trim(now)
    local x = pos(now)
    if count > 0 and last <= x then
      if count > 1 then redis.call('DEL', spans_key) end
      count, inline, last = 0, nil, 0
    elseif count > 1 then
      local before = redis.call('ZREVRANGEBYSCORE', spans_key, x, '-inf', 'LIMIT', 0, 1)
      if before[1] then
        local s = parse(before[1])
        local bound = '(' .. int(s[1])
        if s[2] <= x then bound = int(s[1]) end
        local gone = redis.call('ZREMRANGEBYSCORE', spans_key, '-inf', bound)
        if gone > 0 then
          count = count - gone
          if count == 1 then -- the one left moves into the state
            inline = parse(redis.call('ZRANGE', spans_key, 0, 0)[1])
            redis.call('DEL', spans_key)
          end
        end
      end
    end
    if count == 0 then
      ref = now
    elseif x > REBASE_AFTER then
      -- Count from now again before positions grow past exactness.
      if count == 1 then
        inline = {inline[1] - x, inline[2] - x}
      else
        local all = redis.call('ZRANGE', spans_key, 0, -1)
        redis.call('DEL', spans_key)
        for _, m in ipairs(all) do
          local s = parse(m)
          redis.call('ZADD', spans_key, s[1] - x, member({s[1] - x, s[2] - x}))
        end
      end
      last, ref = last - x, now
    end
  end

  -- first_fit is the first multiple of grid in [a, b] at which the free
  -- time free + slope·(x - a) is at least need, or nil.
  local function first_fit(a, b, free, slope, need, grid)
    local x = ceildiv(a, grid) * grid
    if b and x > b then return nil end
    if slope > 0 and free < need then
      x = math.max(x, ceildiv(a + need - free, grid) * grid)
    elseif free + slope * (x - a) < need then
      return nil
    end
    if b and x > b then return nil end
    return x
  end

  -- earliest walks x from at's position: the free time in [x, x + window)
  -- changes slope only where either edge meets a span's start or end.
  function self.earliest(at)
    local a = pos(at)
    local free = window - busy_in(a, a + window)
    if count <= 1 then
      -- One span [s, e): the classic bucket. Where n do not fit, they fit
      -- once the window from x holds the span's end and n events more.
      if free >= need_n then return at end
      return ref + math.max(a, ceildiv(inline[2] - window + need_n, per_micro) * per_micro) / per_micro
    end
    local left, right = spans(a), spans(a + window)
    local li, ri = 1, 1
    while true do
      local ls, rs = left(li), right(ri)
      local left_busy = ls and ls[1] <= a
      local right_busy = rs and rs[1] <= a + window
      local b, slope = nil, 0
      if ls then
        b = ls[1]
        if left_busy then b, slope = ls[2], slope + 1 end
      end
      if rs then
        local next_ = rs[1] - window
        if right_busy then next_, slope = rs[2] - window, slope - 1 end
        if not b or next_ < b then b = next_ end
      end
      local x = first_fit(a, b, free, slope, need_n, per_micro)
      if x then return ref + x / per_micro end
      free = free + slope * (b - a)
      a = b
      if left_busy and a == ls[2] then li = li + 1 end
      if right_busy and a + window == rs[2] then ri = ri + 1 end
    end
  end

  -- record takes the first free time from at on. Every gap it fills joins
  -- the spans on either side, so the spans from at's to the last one
  -- reached become one.
  function self.record(at)
    local x = pos(at)
    if count == 0 or (count == 1 and inline[1] <= x and x <= inline[2]) then
      -- Nothing booked, or at within or at the end of the one span: the
      -- events take the time after it (the classic bucket).
      local s, e = x, x
      if count == 1 then s, e = inline[1], inline[2] end
      inline, count = {s, e + need_n}, 1
      if e + need_n > last then last = e + need_n end
      return string.format('%d %d %d', ref, e, e + need_n)
    end
    local get, prev = spans(x)
    local need, pieces, start, cur, j = need_n, {int(ref)}, x, x, 1
    local merged = {}
    if prev then
      start = prev[1]
      merged[1] = prev
    elseif get(1) and get(1)[1] <= x then
      start = get(1)[1]
    end
    while need > 0 do
      local s = get(j)
      if s and s[1] <= cur then
        if s[2] > cur then cur = s[2] end
        merged[#merged + 1] = s
        j = j + 1
      else
        local take = need
        if s then take = math.min(need, s[1] - cur) end
        pieces[#pieces + 1] = int(cur)
        pieces[#pieces + 1] = int(cur + take)
        need, cur = need - take, cur + take
      end
    end
    local s = get(j)
    if s and s[1] == cur then -- the last piece touches the next span
      cur = s[2]
      merged[#merged + 1] = s
    end
    replace(merged, {{start, cur}})
    return table.concat(pieces, ' ')
  end

  -- give_back frees the server time of pieces "ref s1 e1 s2 e2 ...".
  function self.give_back(pieces)
    local v = nums(pieces)
    if #v < 3 or #v % 2 == 0 then return end
    local shift = v[1] - ref
    if shift < -REBASE_AFTER / per_micro then return end -- long gone
    shift = shift * per_micro
    for k = 2, #v - 1, 2 do
      local from, to = v[k] + shift, v[k + 1] + shift
      local get = spans(from)
      local hit, i = {}, 1
      while get(i) and get(i)[1] < to do
        hit[#hit + 1] = get(i)
        i = i + 1
      end
      local parts = {}
      for _, s in ipairs(hit) do
        if s[1] < from then parts[#parts + 1] = {s[1], from} end
        if s[2] > to then parts[#parts + 1] = {to, s[2]} end
      end
      if #hit > 0 then replace(hit, parts) end
    end
    -- last may have been freed: ask the spans.
    if count == 0 then
      last = 0
    elseif count == 1 then
      last = inline[2]
    else
      last = parse(redis.call('ZRANGE', spans_key, -1, -1)[1])[2]
    end
  end

  function self.room(at)
    local x = pos(at)
    return floordiv(window - busy_in(x, x + window), per_event)
  end

  function self.reset_after(at)
    if count == 0 then return 0 end
    return math.max(0, ceildiv(last - pos(at), per_micro))
  end

  function self.block(until_)
    self.blocked = until_
  end

  function self.empty() return count == 0 end

  -- used: the server time taken within the window from now, in µs rounded
  -- up (what turns booked ahead took in it too: it cannot be told apart).
  function self.used(now)
    local x = pos(now)
    return {busy = ceildiv(busy_in(x, x + window), per_micro)}
  end

  -- seed, into an empty bucket: the server time from now on.
  function self.seed(now, used)
    ref = now
    if used.busy > 0 then
      inline = {0, math.min(used.busy, floordiv(REBASE_AFTER, per_micro)) * per_micro}
      count, last = 1, inline[2]
    end
  end

  -- save writes the state, trimmed or not: the Go twin keeps what this
  -- keeps, also when a clock steps back. A state as it was read is not
  -- written: its TTL, set when it last changed, ends when it would now
  -- (what it holds ends at the same instant), and a task back for its kept
  -- turn then costs no write.
  function self.save(ttl)
    local s
    if count == 1 then
      s = string.format('%d %d 1 %d %d %d', ref, self.blocked, last, inline[1], inline[2])
    else
      s = string.format('%d %d %d %d', ref, self.blocked, count, last)
    end
    if s == state then return end
    redis.call('SET', key, s, 'PX', ttl)
    if count > 1 then redis.call('PEXPIRE', spans_key, ttl) end
  end

  return self
end

-- The steps of the quick decisions (bucket_quick, and book_buckets.lua's
-- on several buckets), on the states most calls find: "ref 0 1 e s e" (one
-- span, no block) or none, read as ref, s, e, count (0 or 1), without a
-- bucket of closures. Units are µs where limit/g is 1: no division then.

-- bucket_read returns key's state trimmed at now as ref, s, e, count,
-- head and mid ("ref 0 1 " and " s " as read: a span grows at its end
-- only, so they are written again as they came) and the state as read;
-- nil for any other state (a block, no span or several, or one to
-- rebase), which new_bucket reads.
local function bucket_read(key, now, per_micro)
  local state = redis.call('GET', key)
  if not state then return now, 0, 0, 0, nil, nil, nil end
  -- %3: the span's end is the last event's end (the form every version reads)
  local head, r, e, mid, s = string.match(state, '^((%-?%d+) 0 1 )(%-?%d+)( (%-?%d+) )%3$')
  if not r then return nil end
  local ref = r + 0
  local x = (now - ref) * per_micro
  e = e + 0
  if e <= x then return now, 0, 0, 0, nil, nil, state end
  if x > REBASE_AFTER then return nil end
  return ref, s + 0, e, 1, head, mid, state
end

-- bucket_earliest is new_bucket's earliest(from) on a quick state.
local function bucket_earliest(ref, s, e, count, per_micro, window, need, from)
  if count == 0 then return from end
  local a = (from - ref) * per_micro
  local b0, b1 = s, e
  if a > b0 then b0 = a end
  if a + window < b1 then b1 = a + window end
  if b1 <= b0 or window - b1 + b0 >= need then return from end
  return ref + math.max(a, ceildiv(e - window + need, per_micro) * per_micro) / per_micro
end

-- bucket_room is new_bucket's room(t) on a quick state.
local function bucket_room(ref, s, e, count, per_micro, per_event, window, t)
  if count == 0 then return floordiv(window, per_event) end
  local y = (t - ref) * per_micro
  local b0, b1 = s, e
  if y > b0 then b0 = y end
  if y + window < b1 then b1 = y + window end
  if b1 <= b0 then return floordiv(window, per_event) end
  return floordiv(window - b1 + b0, per_event)
end

-- bucket_reset is new_bucket's reset_after(t) on a quick state.
local function bucket_reset(ref, e, count, per_micro, t)
  if count == 0 then return 0 end
  return math.max(0, ceildiv(e - (t - ref) * per_micro, per_micro))
end

-- bucket_trimmed writes a state that trimming emptied (as new_bucket's
-- save would), when nothing is recorded on it.
local function bucket_trimmed(key, ref, count, state, slack)
  if count == 0 and state then
    redis.call('SET', key, string.format('%d 0 0 0', ref), 'PX', string.format('%d', math.max(1, ceildiv(slack, 1000))))
  end
end

-- bucket_write records need units at y (in the span, or where there is
-- none: the caller checks) and writes the state; it returns the new span's
-- s and e. now_text and need_text are now and need as the call's text
-- ('' if not): the state of an empty bucket booked at now is written from
-- them, now formatted here if the call did not send it.
local function bucket_write(key, ref, s, e, count, head, mid, per_micro, need, y, now, slack, now_text, need_text)
  if count == 0 then s, e = y, y end
  e = e + need
  -- At least 1 ms: e is past now.
  local life = e - (now - ref) * per_micro
  if per_micro ~= 1 then life = ceildiv(life, per_micro) end
  local ttl = string.format('%d', ceildiv(life + slack, 1000))
  if head then
    local last = string.format('%d', e)
    redis.call('PSETEX', key, ttl, head .. last .. mid .. last)
  elseif s == 0 and need_text ~= '' then -- ref is now, e is need: one number to format at most
    if now_text == '' then now_text = string.format('%d', ref) end
    redis.call('PSETEX', key, ttl, now_text .. ' 0 1 ' .. need_text .. ' 0 ' .. need_text)
  else
    redis.call('PSETEX', key, ttl, string.format('%d 0 1 %d %d %d', ref, e, s, e))
  end
  return s, e
end

-- bucket_quick is allow_bucket.lua's decision (key, now, per_micro,
-- per_event, window, need in units, start, max_wait, slack; now and need
-- as the call's text) for the quick states, booked at the end of the one
-- span or where there is none: new_bucket's trim, earliest, record, room,
-- reset_after and save for those. It returns nil, having written nothing,
-- for any other state (new_bucket decides then). A booking's reply is {1,
-- now, at, remaining, reset_after, ref, from}: no retry_after (0), and its
-- pieces, "ref from to", as ref and from, which algorithms formats with to
-- = from + need: formatting numbers costs the server more than the rest of
-- the decision, and each value of a reply costs it too (about 1,000
-- instructions): an empty bucket booked at now replies {1, now, at,
-- remaining, reset_after}, its ref now and from 0.
local function bucket_quick(key, now, per_micro, per_event, window, need, start, max_wait, slack, now_text, need_text)
  local ref, s, e, count, head, mid, state = bucket_read(key, now, per_micro)
  if not ref then return nil end
  -- bucket_earliest and bucket_room inline: each call of a function of
  -- this many arguments costs about 2% of the decision.
  local at, busy = start, 0
  if count == 1 then
    local a = (start - ref) * per_micro
    local b0, b1 = s, e
    if a > b0 then b0 = a end
    if a + window < b1 then b1 = a + window end
    if b1 > b0 then busy = b1 - b0 end
    if start - now <= max_wait and window - busy < need then
      at = ref + math.max(a, ceildiv(e - window + need, per_micro) * per_micro) / per_micro
    end
  end
  if at - now > max_wait then
    local left = 0
    if start == now then left = floordiv(window - busy, per_event) end
    bucket_trimmed(key, ref, count, state, slack)
    return {0, now, at, left, at - now, math.max(start - now, bucket_reset(ref, e, count, per_micro, now)), ''}
  end
  local y = (at - ref) * per_micro
  if count == 1 and (y < s or y > e) then return nil end
  local e0 = y
  if count == 1 then e0 = e end
  s, e = bucket_write(key, ref, s, e, count, head, mid, per_micro, need, y, now, slack, now_text, need_text)
  local z = y + window
  if z > e then z = e end
  local taken = z - s
  if y > s then taken = z - y end
  if taken < 0 then taken = 0 end
  local reset = e - y
  if per_micro ~= 1 then reset = ceildiv(reset, per_micro) end
  -- floordiv(window - taken, per_event), inline as the steps above.
  local free = window - taken
  local r = free % per_event
  if r < 0 then r = r + per_event elseif r >= per_event then r = r - per_event end
  if count == 0 and at == now then -- ref is now and from 0: two values fewer
    return {1, now, at, (free - r) / per_event, reset}
  end
  return {1, now, at, (free - r) / per_event, at - now + reset, ref, e0}
end
