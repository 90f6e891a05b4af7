
-- Epilogue shared by every rate-limit script (lua.go puts it after the
-- body). The body has loaded its state and defined:
--   blocked        µs until which the key is blocked (0: it is not)
--   decide(at)     -> fits, remaining, retry_after, reset_after (µs from at);
--                     changes nothing
--   record(at, ttl)  counts n events at `at`; the key then lives ttl ms
--   give_back(at)    uncounts n events that were counted at `at`
--   block(ttl)       stores blocked; the key then lives ttl ms
-- ARGV[8] picks the operation:
--   'allow'   count n events now if they fit
--   'reserve' the same, or else count them at the earliest instant they fit
--             (and not before ARGV[10] µs) if that is at most ARGV[9] µs
--             away: the caller acts then, and later callers see them counted
--   'cancel'  give back n events reserved at ARGV[9]
--   'block'   count nothing for ARGV[9] µs from now (a longer block stays)
--   'peek'    how many events fit now (remaining) and how long the key is
--             still blocked (retry_after), counting nothing
-- Reply: {allowed (1|0), remaining, retry_after, reset_after, delay, at}:
-- all µs; delay is how long after now the events were counted (at).

-- ttl is the TTL in ms of a key whose state must live `life` µs from now:
-- longer if a block outlives it.
local function ttl(life)
  return ceildiv(math.max(life, blocked - now) + slack, 1000)
end

local op = ARGV[8]
if op == 'cancel' then
  give_back(tonumber(ARGV[9]))
  return {1, 0, 0, 0, 0, tonumber(ARGV[9])}
end

if op == 'block' then
  local until_ = now + tonumber(ARGV[9])
  if until_ > blocked then
    local _, _, _, reset = decide(now)
    blocked = until_
    block(ttl(reset))
  end
  return {1, 0, 0, 0, 0, blocked}
end

-- start: the earliest instant the events may be counted at.
local start = math.max(now, blocked, tonumber(ARGV[10]))
local fits, remaining, retry, reset = decide(start)
if op == 'peek' then
  -- decide's remaining is what is left after the n events when they fit.
  if start > now then
    remaining = 0
  elseif fits then
    remaining = remaining + n
  end
  return {0, remaining, start - now, 0, 0, now}
end
if fits and start == now then
  record(now, ttl(reset))
  return {1, remaining, 0, reset, 0, now}
end
local wait = start - now
if not fits then wait = wait + retry end
if start > now then remaining = 0 end
if op == 'reserve' and wait <= tonumber(ARGV[9]) then
  local at = now + wait
  local fits_then, remaining_then, _, reset_then = decide(at)
  if not fits_then then
    return redis.error_reply('sluice: n did not fit at their own turn')
  end
  record(at, ttl(wait + reset_then))
  return {1, remaining_then, 0, wait + reset_then, wait, at}
end
return {0, remaining, wait, (start - now) + reset, 0, now}
