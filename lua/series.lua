-- series: one turn for each of several IDs, booked one after another on
-- the same limits of one slot, in one run: what as many runs of book.lua
-- would book, each with every claim's ID that turn's, without their
-- per-turn clock, state reads and writes. The twin of algorithms.Series.
-- The IDs must have no turn kept under them (they are not read).
--
-- KEYS[3i-2], KEYS[3i-1] -> claim i's state and aux keys (see each
--            algorithm), i = 1..c; KEYS[3i] -> where claim i's recent
--            throttles are counted (common.lua's recent_note), in the same
--            slot (the aux key again when they are not)
-- KEYS[3c + c(t-1) + i] -> the key of claim i's turn kept under the ID of
--            turn t, in the same slot (string "at;pieces", as book.lua's)
-- KEYS[3c + c*T + 1] -> optional (a remind): a sorted set in the same
--            slot, where a turn more than a wait away notes its member,
--            scored a lead before the turn, all in one ZADD
-- ARGV[1] -> now in µs, or '' to read Redis TIME
-- ARGV[2] -> not before (µs)
-- ARGV[3] -> the longest wait (µs)
-- ARGV[4] -> the shortest (µs): a turn sooner than this is not booked
-- ARGV[5] -> TTL slack (µs), added to every TTL
-- ARGV[6] -> how long after its instant a kept turn is still given (µs;
--            -1: however long)
-- ARGV[7] -> c, how many claims
-- ARGV[8] -> T, how many turns at most
-- ARGV[9 + 6(i-1) ...] -> claim i: algorithm, limit, period, burst,
--            windows, n
-- ARGV[9 + 6c ...] -> a remind, optional: lead, wait (µs), then T members
-- Output  -> {now, booked, then per turn booked: at, reminded (1 or 0),
--            then per claim: remaining, reset_after, pieces}; times in µs,
--            reset_after relative to now. The series stops at the first
--            turn that is not booked: beyond the longest wait, sooner than
--            the shortest, or not found (book.lua's refusal); nothing is
--            counted for it and the turns after it.
--
-- Recent throttles: each booked turn counts, for each claim with a recent
-- key whose own earliest turn was later than the turn's start, its n, as
-- that turn's book.lua would; the sum, once per claim, at the run's one
-- now (what those runs would have counted within one instant). The turn
-- the series stops at is not counted: book.lua would count it, refused or
-- not, but the series did not book it, and its caller books it with
-- book.lua, which counts it then.

local constructors = {
  fixed_window = new_counter, sliding_counter = new_sliding_counter,
  sliding_log = new_sliding_log,
  token_bucket = new_bucket, leaky_bucket = new_bucket,
}

local now = clock()
local max_wait, min_ahead = tonumber(ARGV[3]), tonumber(ARGV[4])
local slack, late = tonumber(ARGV[5]), tonumber(ARGV[6])
local nclaims, nturns = tonumber(ARGV[7]), tonumber(ARGV[8])
local start = math.max(now, tonumber(ARGV[2]))
local claims = {}
for i = 1, nclaims do
  local a = 9 + 6 * (i - 1)
  local p = {limit = tonumber(ARGV[a + 1]), period = tonumber(ARGV[a + 2]), burst = tonumber(ARGV[a + 3]),
    windows = tonumber(ARGV[a + 4]), n = tonumber(ARGV[a + 5]), member = ''}
  local g = constructors[ARGV[a]](KEYS[3 * i - 2], KEYS[3 * i - 1], p)
  g.trim(now)
  claims[i] = {g = g, n = p.n, from = math.max(start, g.blocked), throttled = 0}
  if KEYS[3 * i] ~= KEYS[3 * i - 1] then claims[i].recent_key = KEYS[3 * i] end
end
local remind = 9 + 6 * nclaims
local lead, remind_after = tonumber(ARGV[remind]), tonumber(ARGV[remind + 1])
local noted = {} -- the ZADD's scores and members

local reply = {now, 0}
local booked = 0
while booked < nturns do
  -- book.lua's search, each turn on the state the turns before it left.
  local at = start
  for _, c in ipairs(claims) do
    c.own = c.from
    if c.from - now <= max_wait then c.own = c.g.earliest(c.from) end
    if c.own > at then at = c.own end
  end
  local settled
  at, settled = settle_instant(claims, at, now, max_wait)
  if not settled or at - now > max_wait or at - now < min_ahead then break end

  booked = booked + 1
  for _, c in ipairs(claims) do
    if c.recent_key and c.own > start then c.throttled = c.throttled + c.n end
  end
  local k = #reply
  reply[k + 1], reply[k + 2] = at, 0
  if lead and at - now > remind_after then
    noted[#noted + 1] = at - lead
    noted[#noted + 1] = ARGV[remind + 1 + booked]
    reply[k + 2] = 1
  end
  -- Kept until the turn is too late to be given (see late), as book.lua
  -- keeps it.
  local life = ceildiv(at - now + math.max(late, 0) + slack, 1000)
  for i, c in ipairs(claims) do
    local pieces = c.g.record(at)
    k = #reply
    reply[k + 1], reply[k + 2], reply[k + 3] = c.g.room(at), at - now + c.g.reset_after(at), pieces
    if at > now then
      redis.call('SET', KEYS[3 * nclaims + nclaims * (booked - 1) + i], string.format('%d;', at) .. pieces, 'PX', life)
    end
  end
end
reply[2] = booked

-- Every state once, as the last of those runs would leave it (and as
-- trimming left it when none was booked).
for _, c in ipairs(claims) do
  local life = math.max(c.g.reset_after(now), c.g.blocked - now, 0)
  c.g.save(math.max(1, ceildiv(life + slack, 1000)))
  if c.throttled > 0 then recent_note(c.recent_key, now, c.throttled) end
end
if #noted > 0 then redis.call('ZADD', KEYS[3 * nclaims + nclaims * nturns + 1], unpack(noted)) end
return reply
