-- allow: one limit's AllowN or ReserveN with the fewest keys and
-- arguments: book.lua's book of one claim with no ID, nothing to give back,
-- no replaced limit, no recent throttles and no remind, which is most
-- calls. lua.go puts it after the one constructor it needs, new_limit, and
-- the algorithm's quick decision, fast_limit or nil (as a script), or
-- passes it both (as a function).
--
-- KEYS[1], KEYS[2] -> the state and aux keys (see the algorithm)
-- ARGV[1] -> now in µs, or '' to read Redis TIME
-- ARGV[2..7] -> algorithm, limit, period, burst, windows, n
-- ARGV[8] -> not before (µs)
-- ARGV[9] -> the longest wait (µs); 0 counts now or never
-- ARGV[10] -> TTL slack (µs), added to every TTL
-- Output  -> book.lua's for one claim: {ok (1: booked, 0: not), now, at,
--            remaining, retry_after, reset_after, pieces}

local now = clock()
local p = {limit = tonumber(ARGV[3]), period = tonumber(ARGV[4]), burst = tonumber(ARGV[5]),
  windows = tonumber(ARGV[6]), n = tonumber(ARGV[7]), member = ''}
local start, max_wait, slack = math.max(now, tonumber(ARGV[8])), tonumber(ARGV[9]), tonumber(ARGV[10])
-- The algorithm's quick decision for the states most calls find, if it
-- has one (fast_limit, or nil).
if fast_limit then
  local reply = fast_limit(KEYS[1], KEYS[2], p, now, start, max_wait, slack)
  if reply then return reply end
end
local g = new_limit(KEYS[1], KEYS[2], p)
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
