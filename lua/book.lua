-- book: one operation on several keys, each a limit of its own algorithm,
-- atomically. The twin of algorithms.Book and algorithms.Peek.
--
-- KEYS[6i-5], KEYS[6i-4] -> claim i's state and aux keys (see each
--            algorithm); KEYS[6i-3] -> the key of claim i's turn kept under
--            its ID (string "at;pieces"), in the same slot (the aux key
--            again when the claim has no ID); KEYS[6i-2] -> where claim i's
--            recent throttles are counted (common.lua's recent_note), in
--            the same slot (the aux key again when they are not);
--            KEYS[6i-1], KEYS[6i] -> the state and aux keys of the limit
--            claim i's replaces (a live change), in the same slot (the aux
--            key twice when there is none)
-- ARGV[1] -> now in µs, or '' to read Redis TIME
-- ARGV[2] -> op: book, cancel, block or peek
-- ARGV[3] -> book: not before (µs; "+d": d µs after now); block: for how
--            long (µs)
-- ARGV[4] -> book: the longest wait (µs); 0 counts now or never
-- ARGV[5] -> book: '1' if the turn must be at not before exactly (no
--            recent throttle counted), '2' if recent throttles are counted
--            only where the booking is refused, '0' otherwise
-- ARGV[6] -> TTL slack (µs), added to every TTL
-- ARGV[7] -> book: how long after its instant a kept turn is still given
--            (µs; -1: however long)
-- ARGV[8] -> book: a turn is kept under the claims' IDs only if it is
--            more than this many µs away (0: any turn after now)
-- ARGV[9] -> how many claims
-- ARGV[10 + 14(i-1) ...] -> claim i: algorithm, limit, period, burst,
--            windows, n, pieces to give back first ('' for none), ID ('' for
--            none), member (fair_share: the key value; '' otherwise); then
--            the replaced limit's algorithm ('' for none), limit, period,
--            burst and windows: a claim whose state counts nothing takes
--            over what that limit counted up to now (and its block)
-- KEYS[6n+1], ARGV[10 + 14n ...] -> book, optional (a remind): a sorted set
--            in the same slot, a member, a lead and a wait (µs): a turn
--            booked more than the wait away is noted there, the member
--            scored the lead before the turn
-- Output  -> {ok (1: booked, 2: given the turns kept under the claims' IDs,
--            3: booked and noted as the remind asked, 0: not), now, at,
--            then per claim: remaining, retry_after,
--            reset_after, pieces}; times in µs, relative to now but now and
--            at. book: at is the turn, or the earliest instant found at
--            which all would fit. peek: retry_after is how long the key is
--            still blocked, reset_after how long until what it counted
--            has passed. block: at is until when.

local constructors = {
  fixed_window = new_counter, sliding_counter = new_sliding_counter,
  sliding_log = new_sliding_log,
  token_bucket = new_bucket, leaky_bucket = new_bucket,
  fair_share = new_fair,
}

local now = clock()
local op = ARGV[2]
local slack, late, keep_after = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
local claims = {}
for i = 1, tonumber(ARGV[9]) do
  local a = 10 + 14 * (i - 1)
  local p = {limit = tonumber(ARGV[a + 1]), period = tonumber(ARGV[a + 2]), burst = tonumber(ARGV[a + 3]),
    windows = tonumber(ARGV[a + 4]), n = tonumber(ARGV[a + 5]), member = ARGV[a + 8]}
  local g = constructors[ARGV[a]](KEYS[6 * i - 5], KEYS[6 * i - 4], p)
  g.trim(now)
  if ARGV[a + 9] ~= '' and g.empty() then
    -- Take over what the replaced limit counted (algorithms.TakeOver).
    local q = {limit = tonumber(ARGV[a + 10]), period = tonumber(ARGV[a + 11]), burst = tonumber(ARGV[a + 12]),
      windows = tonumber(ARGV[a + 13]), n = p.n, member = ''}
    local old = constructors[ARGV[a + 9]](KEYS[6 * i - 1], KEYS[6 * i], q)
    old.trim(now)
    g.seed(now, old.used(now))
    g.trim(now)
    if old.blocked > g.blocked then g.block(old.blocked) end
  end
  -- A task let out of its line books: what was held for it goes.
  if g.released and op == 'book' then g.released(ARGV[a + 7]) end
  local c = {g = g, n = p.n, give_back = ARGV[a + 6], id = ARGV[a + 7], id_key = KEYS[6 * i - 3]}
  if KEYS[6 * i - 2] ~= KEYS[6 * i - 4] then c.recent_key = KEYS[6 * i - 2] end
  if c.id ~= '' then
    local kept = redis.call('GET', c.id_key)
    if kept then
      local at, pieces = string.match(kept, '^(%-?%d+);(.*)$')
      c.kept = {at = tonumber(at), pieces = pieces}
    end
  end
  claims[i] = c
end

-- save writes what changed (each state knows), with a TTL that covers the
-- state and its block.
local function save(c)
  local life = math.max(c.g.reset_after(now), c.g.blocked - now, 0)
  c.g.save(math.max(1, ceildiv(life + slack, 1000)))
end

local reply = {0, now, now}

-- append adds one claim's answer to the reply.
local function append(r, remaining, retry_after, reset_after, pieces)
  local k = #r
  r[k + 1], r[k + 2], r[k + 3], r[k + 4] = remaining, retry_after, reset_after, pieces
end

if op == 'peek' then
  for _, c in ipairs(claims) do
    local room, blocked_for = 0, 0
    if c.g.blocked > now then blocked_for = c.g.blocked - now else room = c.g.room(now) end
    append(reply, room, blocked_for, c.g.reset_after(now), '')
    save(c) -- what trimming changed
  end
  return reply
end

if op == 'block' then
  local until_ = now + tonumber(ARGV[3])
  reply[3] = until_
  for _, c in ipairs(claims) do
    if until_ > c.g.blocked then c.g.block(until_) end
    save(c)
    append(reply, 0, 0, 0, '')
  end
  return reply
end

-- forget gives back the turn a claim keeps under its ID, and drops it.
local function forget(c)
  if c.kept then
    c.g.give_back(c.kept.pieces)
    redis.call('DEL', c.id_key)
    c.kept = nil
  end
end

if op == 'cancel' then
  reply[1] = 1
  for _, c in ipairs(claims) do
    -- Given back by ID only when kept: giving back twice would free what
    -- others booked since.
    if c.id ~= '' then forget(c) elseif c.give_back ~= '' then c.g.give_back(c.give_back) end
    save(c)
    append(reply, 0, 0, 0, '')
  end
  return reply
end

for _, c in ipairs(claims) do
  if c.give_back ~= '' then
    c.g.give_back(c.give_back)
    -- A turn given back is no longer kept under its ID: it moves.
    if c.id ~= '' then
      redis.call('DEL', c.id_key)
      c.kept = nil
    end
  end
end

-- book: a turn every claim keeps under its ID, at one instant not too long
-- past, is the booking (the caller is back for it, or asks again after a
-- lost reply); kept turns that are not are given back.
local kept_at = claims[1].kept and claims[1].kept.at
for _, c in ipairs(claims) do
  if not c.kept or c.kept.at ~= kept_at then kept_at = nil end
end
if kept_at and (late < 0 or kept_at >= now - late) then
  reply[1], reply[3] = 2, kept_at
  for _, c in ipairs(claims) do
    local at = math.max(kept_at, now)
    append(reply, c.g.room(kept_at), 0, at - now + c.g.reset_after(at), c.kept.pieces)
    -- Nothing counted, but trimming may have moved the state's parts
    -- between its keys: the state is written as it now is.
    save(c)
  end
  return reply
end
for _, c in ipairs(claims) do forget(c) end

-- Each claim alone first (its own wait tells the caller which limit
-- refused), then the earliest instant at which all fit: each claim's
-- earliest turn only moves forward as the instant asked about does.
local max_wait, exact = tonumber(ARGV[4]), ARGV[5] == '1'
local start = now
if string.sub(ARGV[3], 1, 1) == '+' then
  start = now + tonumber(string.sub(ARGV[3], 2))
else
  start = math.max(now, tonumber(ARGV[3]))
end
local at = start
for _, c in ipairs(claims) do
  c.from = math.max(start, c.g.blocked)
  c.own = c.from
  if c.from - now <= max_wait and not c.g.follows then c.own = c.g.earliest(c.from) end
  if c.own > at then at = c.own end
end
-- A fair share is asked last, told where the claims before it (the
-- drain) and after it (the key's own quotas) would put the turn.
for i, c in ipairs(claims) do
  if c.g.follows and c.from - now <= max_wait then
    local drain_at, own_at = c.from, c.from
    for j, other in ipairs(claims) do
      if j < i then drain_at = math.max(drain_at, other.own) elseif j > i then own_at = math.max(own_at, other.own) end
    end
    c.g.follows(drain_at, own_at)
    c.own = c.g.earliest(math.max(drain_at, own_at))
    if c.own > at then at = c.own end
  end
end
local settled
at, settled = settle_instant(claims, at, now, max_wait)
reply[3] = at

-- A claim whose own limit could not give its events the instant asked
-- for throttled them: counted (not a claim whose turn another claim moved,
-- nor one asked to book exactly at an instant that other slots chose: they
-- counted on their first ask).
local function note_throttled()
  for _, c in ipairs(claims) do
    if c.recent_key and c.own > start then recent_note(c.recent_key, now, c.n) end
  end
end
if ARGV[5] == '0' then note_throttled() end

if not settled or at - now > max_wait or (exact and at ~= start) then
  if ARGV[5] == '2' then note_throttled() end
  for _, c in ipairs(claims) do
    local room = 0
    if c.from == now then room = c.g.room(now) end
    local reset = math.max(c.from - now, c.g.reset_after(now))
    append(reply, room, c.own - now, reset, '')
    save(c) -- what trimming and giving back changed
  end
  return reply
end

reply[1] = 1
local remind = 10 + 14 * #claims
if ARGV[remind] and at - now > tonumber(ARGV[remind + 2]) then
  redis.call('ZADD', KEYS[6 * #claims + 1], at - tonumber(ARGV[remind + 1]), ARGV[remind])
  reply[1] = 3
end
for _, c in ipairs(claims) do
  local pieces = c.g.record(at)
  append(reply, c.g.room(at), 0, at - now + c.g.reset_after(at), pieces)
  save(c)
  if c.id ~= '' and at - now > keep_after then
    -- Kept until the turn is too late to be given (see late).
    local life = at - now + math.max(late, 0) + slack
    redis.call('SET', c.id_key, string.format('%d;', at) .. pieces, 'PX', ceildiv(life, 1000))
  end
end
return reply
