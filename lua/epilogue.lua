
-- Epilogue shared by every sluice script (lua.go puts it after the body).
-- The body has defined, on its loaded state:
--   decide(at)    -> fits, remaining, retry_after, reset_after (µs from at);
--                    changes nothing
--   record(at)    -> counts n events at `at`
--   give_back(at) -> uncounts n events that were counted at `at`
-- ARGV[8] picks the operation:
--   'allow'   count n events now if they fit
--   'reserve' the same, or else count them at the earliest instant they fit
--             (now + retry_after) if that is at most ARGV[9] µs away: the
--             caller acts then, and later callers see them counted
--   'cancel'  give back n events reserved at ARGV[9]
-- Reply: {allowed (1|0), remaining, retry_after, reset_after, delay, at}:
-- all µs; delay is how long after now the events were counted (at).

local op = ARGV[8]
if op == 'cancel' then
  give_back(tonumber(ARGV[9]))
  return {1, 0, 0, 0, 0, tonumber(ARGV[9])}
end

local fits, remaining, retry, reset = decide(now)
if fits then
  record(now)
  keep_for(KEYS[1], reset)
  return {1, remaining, 0, reset, 0, now}
end
if op == 'reserve' and retry <= tonumber(ARGV[9]) then
  local at = now + retry
  local fits_then, remaining_then, _, reset_then = decide(at)
  if not fits_then then
    return redis.error_reply('sluice: n did not fit at its own retry_after')
  end
  record(at)
  keep_for(KEYS[1], retry + reset_then)
  return {1, remaining_then, 0, retry + reset_then, retry, at}
end
return {0, remaining, retry, reset, 0, now}
