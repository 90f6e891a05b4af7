-- sliding_log: at most limit events in any interval (t - period, t].
--
-- KEYS[1] -> sorted set of admitted events, scored by their time in µs; each
--            event is its own member ("time:seq"), so n events are n members
-- ARGV    -> now, limit, period, burst (unused), windows (unused), n, ttl slack (see prelude)
-- Output  -> {allowed (1|0), remaining, retry_after µs, reset_after µs}

local key = KEYS[1]
redis.call('ZREMRANGEBYSCORE', key, '-inf', int(now - period))
local count = redis.call('ZCARD', key)
local newest = now -- the newest event's time (count is 0 only on the way to admitting)
if count > 0 then
  newest = tonumber(redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')[2])
end

if count + n > limit then
  -- The call fits once the (count + n - limit)th oldest event has aged out.
  local k = count + n - limit
  local kth = tonumber(redis.call('ZRANGE', key, k - 1, k - 1, 'WITHSCORES')[2])
  return {0, math.max(0, limit - count), kth + period - now, newest + period - now}
end

-- NX makes a member that already exists (only possible when the clock
-- stepped back) fail to add, and the loop then tries the next seq.
local seq, added = count, 0
while added < n do
  seq = seq + 1
  added = added + redis.call('ZADD', key, 'NX', int(now), int(now) .. ':' .. seq)
end
newest = math.max(newest, now)
keep_for(key, newest + period - now)
return {1, limit - count - n, 0, newest + period - now}
