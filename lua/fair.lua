-- fair: a queue's drain shared among the values of a key (tenants, say) in
-- proportion to their weights. A key may hold booked turns in the future
-- (not yet passed) for at most its share: w·u cost units, W the weights of
-- the keys active now (with turns in the future, or tasks waiting in their
-- line) and u = max(1, floor(depth/W)) whole units per weight (the depth
-- alone when the key is the only one active), and always at least one
-- task. Shares in whole units per weight keep the weights' ratio exact at
-- any depth: depth·w/W rounded down gave vip 3 : std 1 a ratio of 2 at a
-- depth of 3 turns, and 4 at 6. So all keys together hold at most
-- max(depth, W) turns ahead. A key that books less leaves the rest to the
-- others. Since all keys book at the drain's one tail, each key's turns
-- pass at a rate in proportion to what it may hold ahead: its share of
-- the drain (a window through one FIFO). Tasks a key cannot book now wait
-- in its line in Redis, and the queue's waker (wake.lua) lets them out as
-- their key's share allows.
--
-- A turn due within the lead (one turn of the drain, at most FAIR_LEAD) no
-- longer counts: the key's next task is let out of its line and books
-- while that turn is still to come, so a key alone with a share of one
-- turn (a drain of 5/s) keeps every turn of the drain, not one per trip
-- through its line. (At higher rates the share itself covers that trip.)
--
-- A key held back by its own limits (a quota per customer) books where
-- they put its turn, later than the drain's next: such a turn is paced by
-- the key, not by the drain's one tail, and holding it ahead takes no
-- share of the drain's near future from the others. It is kept apart
-- ('f', not counted in c:<m>), so that the key takes its full quota while
-- the rest of the drain goes to the others; and so that a key whose own
-- limit is above its share does not take more than its share by pacing
-- itself, its paced turns are spaced at its share's rate (g:<m>, a GCRA
-- with a burst of its share). A key books paced turns at most FAIR_REACH
-- ahead, so that the pace follows the shares as keys come and go: a task
-- whose paced turn would be further waits in its key's line, and the
-- waker lets none of the key's tasks out before b:<m>, when its turn is
-- within reach.
--
-- state (hash, the queue's hash tag):
--   W      -> the weights of the active keys
--   s      -> a sequence, for unique members
--   c:<m>  -> the cost key m holds in the future (turns and releases)
--   w:<m>  -> m's weight, while m is active
--   p:<m>  -> m's tasks waiting in its line
--   q:<m>  -> the cost of the paced turns m holds in the future
--   g:<m>  -> the instant m's paced turns reach at its share's rate, while
--             it holds some
--   b:<m>  -> not before: m's tasks stay in its line until then
-- aux (sorted set, same slot): what keys hold in the future, by instant:
--   't <m> <n> <seq>'  a turn of n
--   'f <m> <n> <seq>'  a turn of n paced by m's own limits (not counted)
--   'r <m> <n> <id>'   n for a task let out of its line, booking under id
-- lines (sorted set, all scores 0, in order of members):
--   '<m> <seq, 15 digits> <n> <task id>'
-- keys (sorted set): the keys with a line, by when last served
-- Key values m are escaped as hash tags are (no spaces).

local FAIR_FAR = 2 ^ 50 -- µs beyond any booking's wait: a refusal
-- FAIR_LEAD (µs): the longest lead (fairLead in jobs/fair.go): about how
-- long a task let out of its line takes to reach a worker and book.
local FAIR_LEAD = 200000
-- FAIR_REACH (µs): how far ahead a key books turns paced by its own
-- limits (see jobs/fair.go).
local FAIR_REACH = 1000000

local function fair_num(state, field)
  return tonumber(redis.call('HGET', state, field) or 0)
end

-- fair_touch makes m active (its weight counts in W), at weight: a live
-- change of weights takes effect as each key is touched again.
local function fair_touch(state, m, weight)
  local was = tonumber(redis.call('HGET', state, 'w:' .. m) or 0)
  if was ~= weight then
    redis.call('HSET', state, 'w:' .. m, weight)
    redis.call('HINCRBY', state, 'W', weight - was)
  end
end

-- fair_settle makes m inactive once it holds nothing and waits for nothing.
local function fair_settle(state, m)
  if fair_num(state, 'c:' .. m) <= 0 and fair_num(state, 'p:' .. m) <= 0 then
    local w = redis.call('HGET', state, 'w:' .. m)
    if w then redis.call('HINCRBY', state, 'W', -tonumber(w)) end
    redis.call('HDEL', state, 'w:' .. m, 'c:' .. m, 'p:' .. m, 'b:' .. m)
  end
end

-- fair_unpace forgets n of m's paced turns; its pace once it holds none.
local function fair_unpace(state, m, n)
  if redis.call('HINCRBY', state, 'q:' .. m, -n) <= 0 then redis.call('HDEL', state, 'q:' .. m, 'g:' .. m) end
end

-- fair_lead is the lead of a drain of limit per period (µs): one turn, at
-- most FAIR_LEAD.
local function fair_lead(limit, period)
  return math.min(FAIR_LEAD, ceildiv(period, limit))
end

-- fair_trim forgets what passed, or is due within lead: turns, and
-- releases never booked.
local function fair_trim(state, aux, now, lead)
  local gone = redis.call('ZRANGEBYSCORE', aux, '-inf', now + lead)
  if #gone == 0 then return end
  redis.call('ZREMRANGEBYSCORE', aux, '-inf', now + lead)
  for _, member in ipairs(gone) do
    local kind, m, n = string.match(member, '^(%a) (%S+) (%d+)')
    if kind == 'f' then
      fair_unpace(state, m, tonumber(n))
    else
      redis.call('HINCRBY', state, 'c:' .. m, -tonumber(n))
      fair_settle(state, m)
    end
  end
end

-- fair_share is what m may hold ahead (see above).
local function fair_share(state, m, weight, depth)
  local W = fair_num(state, 'W')
  if redis.call('HEXISTS', state, 'w:' .. m) == 0 then W = W + weight end
  if W <= weight then return depth end
  return weight * math.max(1, math.floor(depth / W))
end

-- fair_fits reports whether m may hold n more: its share, or one task.
local function fair_fits(state, m, weight, depth, n)
  local c = fair_num(state, 'c:' .. m)
  return c <= 0 or c + n <= fair_share(state, m, weight, depth)
end

-- fair_keep makes key's TTL at least ttl ms: every script that touches the
-- state keeps it as long as what it holds.
local function fair_keep(key, ttl)
  if redis.call('PTTL', key) < ttl then redis.call('PEXPIRE', key, ttl) end
end

-- new_fair is the claim of one key value p.member on a queue's share:
-- p.windows its weight, p.burst the depth, p.limit/p.period the drain.
local function new_fair(state, aux, p)
  local self = {blocked = 0}
  local m, weight, depth = p.member, p.windows, p.burst

  function self.trim(now)
    self.lead = fair_lead(p.limit, p.period)
    fair_trim(state, aux, now, self.lead)
    self.now = now
  end

  -- follows tells the claim where the drain would put the turn (drain_at)
  -- and where the key's own limits would (own_at): later, the key paces
  -- itself (book.lua asks this before earliest).
  function self.follows(drain_at, own_at)
    self.paced = own_at > drain_at
  end

  -- A paced turn fits at its share's rate (GCRA: at most its share ahead
  -- over the drain's span of depth turns). Otherwise a key that may not
  -- hold more now cannot at any instant: the refusal sends the task to its
  -- line.
  function self.earliest(at)
    if self.paced then
      local step = ceildiv(p.period * depth, p.limit * fair_share(state, m, weight, depth))
      local span = ceildiv(p.period * depth, p.limit)
      local tat = math.max(fair_num(state, 'g:' .. m), at)
      local paced_at = math.max(at, tat + p.n * step - span)
      if paced_at <= self.now + FAIR_REACH then return paced_at end
      redis.call('HSET', state, 'b:' .. m, paced_at - FAIR_REACH)
      return self.now + FAIR_FAR
    end
    if fair_fits(state, m, weight, depth, p.n) then return at end
    return self.now + FAIR_FAR
  end

  function self.record(at)
    if at <= self.now + self.lead then return '' end -- passes at once: holds nothing
    local seq = redis.call('HINCRBY', state, 's', 1)
    if self.paced then
      local step = ceildiv(p.period * depth, p.limit * fair_share(state, m, weight, depth))
      redis.call('HSET', state, 'g:' .. m, math.max(fair_num(state, 'g:' .. m), at) + p.n * step)
      redis.call('HINCRBY', state, 'q:' .. m, p.n)
      local member = string.format('f %s %d %d', m, p.n, seq)
      redis.call('ZADD', aux, at, member)
      return member
    end
    local member = string.format('t %s %d %d', m, p.n, seq)
    redis.call('ZADD', aux, at, member)
    redis.call('HINCRBY', state, 'c:' .. m, p.n)
    fair_touch(state, m, weight)
    return member
  end

  function self.give_back(pieces)
    if pieces ~= '' and redis.call('ZREM', aux, pieces) == 1 then
      local kind, n = string.match(pieces, '^(%a) %S+ (%d+)')
      if kind == 'f' then
        fair_unpace(state, m, tonumber(n))
        return
      end
      redis.call('HINCRBY', state, 'c:' .. m, -tonumber(n))
      fair_settle(state, m)
    end
  end

  -- release takes back what the waker held for the task booking under id
  -- when it let the task out of its line: the turn replaces it.
  function self.released(id)
    if id ~= '' then self.give_back(string.format('r %s %d %s', m, p.n, id)) end
  end

  function self.room(at)
    return math.max(0, fair_share(state, m, weight, depth) - fair_num(state, 'c:' .. m))
  end

  function self.reset_after(at)
    local last = redis.call('ZRANGE', aux, -1, -1, 'WITHSCORES')[2]
    if not last then return 0 end
    return math.max(0, tonumber(last) - at)
  end

  function self.block(until_) end

  function self.save(ttl)
    for _, key in ipairs({state, aux}) do fair_keep(key, ttl) end
  end

  return self
end
