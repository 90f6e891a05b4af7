
-- Epilogue shared by every sluice script (lua.go puts it after the body).
-- The body has defined, on its loaded state:
--   decide(at)    -> fits, remaining, retry_after, reset_after (µs from at);
--                    changes nothing
--   record(at)    -> counts n events at `at`
--   give_back(at) -> uncounts n events that were counted at `at`
-- KEYS[2] holds the µs until which the key is blocked (absent: it is not).
-- ARGV[8] picks the operation:
--   'allow'   count n events now if they fit
--   'reserve' the same, or else count them at the earliest instant they fit
--             (and not before ARGV[10] µs) if that is at most ARGV[9] µs
--             away: the caller acts then, and later callers see them counted
--   'cancel'  give back n events reserved at ARGV[9]
--   'block'   count nothing for ARGV[9] µs from now (a longer block stays)
-- Reply: {allowed (1|0), remaining, retry_after, reset_after, delay, at}:
-- all µs; delay is how long after now the events were counted (at).

local op = ARGV[8]
if op == 'cancel' then
  give_back(tonumber(ARGV[9]))
  return {1, 0, 0, 0, 0, tonumber(ARGV[9])}
end

local blocked = tonumber(redis.call('GET', KEYS[2])) or 0
if op == 'block' then
  local until_ = now + tonumber(ARGV[9])
  if until_ > blocked then
    redis.call('SET', KEYS[2], int(until_), 'PX', ceildiv(until_ - now + tonumber(ARGV[7]), 1000))
    blocked = until_
  end
  return {1, 0, 0, 0, 0, blocked}
end

-- start: the earliest instant the events may be counted at.
local start = math.max(now, blocked, tonumber(ARGV[10]))
local fits, remaining, retry, reset = decide(start)
if fits and start == now then
  record(now)
  keep_for(KEYS[1], reset)
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
  record(at)
  keep_for(KEYS[1], wait + reset_then)
  return {1, remaining_then, 0, wait + reset_then, wait, at}
end
return {0, remaining, wait, (start - now) + reset, 0, now}
