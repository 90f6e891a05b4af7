-- sliding_log: at most limit events in any interval (t - period, t].
--
-- KEYS[1] -> sorted set of counted events, scored by their time in µs; each
--            event is its own member ("time:seq"), so n events are n members
-- KEYS[2] -> string: µs until which the key is blocked (absent: not)
-- ARGV    -> now, limit, period, burst (unused), windows (unused), n, ttl slack,
--            op, op argument, not before (see lua.go and epilogue.lua)

local key = KEYS[1]
redis.call('ZREMRANGEBYSCORE', key, '-inf', int(now - period))
local size = redis.call('ZCARD', key) -- every event left counts at now
local blocked = tonumber(redis.call('GET', KEYS[2])) or 0

local function decide(at)
  local since = '(' .. int(at - period)
  local count = size
  if at > now then count = redis.call('ZCOUNT', key, since, '+inf') end
  local newest = at -- the newest event's time (there is none only when n fit)
  if count > 0 then
    newest = tonumber(redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')[2])
  end
  if count + n > limit then
    -- n fit once the (count + n - limit)th oldest event has aged out.
    local k = count + n - limit
    local kth = tonumber(redis.call('ZRANGEBYSCORE', key, since, '+inf', 'WITHSCORES', 'LIMIT', k - 1, 1)[2])
    return false, math.max(0, limit - count), kth + period - at, newest + period - at
  end
  return true, limit - count - n, 0, math.max(newest, at) + period - at
end

local function record(at, ttl)
  -- NX makes a member that exists already fail to add; the loop then
  -- tries the next seq, so n events always become n members.
  local seq, added = size, 0
  while added < n do
    seq = seq + 1
    added = added + redis.call('ZADD', key, 'NX', int(at), int(at) .. ':' .. seq)
  end
  redis.call('PEXPIRE', key, ttl)
end

local function give_back(at)
  local events = redis.call('ZRANGEBYSCORE', key, int(at), int(at), 'LIMIT', 0, n)
  if #events > 0 then redis.call('ZREM', key, unpack(events)) end
end

local function block(ttl)
  redis.call('SET', KEYS[2], int(blocked), 'PX', ttl)
end
