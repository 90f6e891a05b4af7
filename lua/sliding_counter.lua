-- sliding_counter: the events of the last `windows` sub-windows of
-- period / windows each (the current one included) add up to at most limit.
--
-- KEYS[1] -> hash: sub-window index (time µs // sub-window µs) -> events
--            counted in it, and b -> µs until which the key is blocked
-- KEYS[2] -> unused (see lua.go)
-- ARGV    -> now, limit, period, burst (unused), windows, n, ttl slack,
--            op, op argument, not before (see lua.go and epilogue.lua)

local key = KEYS[1]
local sub = period / windows -- whole: the caller checks that windows divides period
local fields = redis.call('HGETALL', key)
local live, stale, blocked = {}, {}, 0
for i = 1, #fields, 2 do
  if fields[i] == 'b' then
    blocked = tonumber(fields[i + 1])
  else
    local index = tonumber(fields[i])
    if index <= floordiv(now, sub) - windows then
      stale[#stale + 1] = fields[i]
    else
      live[#live + 1] = {index, tonumber(fields[i + 1])}
    end
  end
end
if #stale > 0 then redis.call('HDEL', key, unpack(stale)) end
table.sort(live, function(a, b) return a[1] < b[1] end)

local function decide(at)
  local current = floordiv(at, sub)
  local total, latest = 0, nil -- latest: the newest sub-window that counts at `at`
  for _, w in ipairs(live) do
    if w[1] > current - windows then
      total = total + w[2]
      latest = w[1]
    end
  end
  if total + n <= limit then
    return true, limit - total - n, 0, (math.max(latest or current, current) + windows) * sub - at
  end
  -- n fit once enough of the oldest sub-windows have slid out; sub-window
  -- i slides out at (i + windows) * sub.
  local need, freed = total + n - limit, 0
  for _, w in ipairs(live) do
    if w[1] > current - windows then
      freed = freed + w[2]
      if freed >= need then
        return false, math.max(0, limit - total), (w[1] + windows) * sub - at, (latest + windows) * sub - at
      end
    end
  end
end

local function record(at, ttl)
  redis.call('HINCRBY', key, int(floordiv(at, sub)), n)
  redis.call('PEXPIRE', key, ttl)
end

local function give_back(at)
  local field = int(floordiv(at, sub))
  if redis.call('HINCRBY', key, field, -n) <= 0 then redis.call('HDEL', key, field) end
end

local function block(ttl)
  redis.call('HSET', key, 'b', int(blocked))
  redis.call('PEXPIRE', key, ttl)
end
