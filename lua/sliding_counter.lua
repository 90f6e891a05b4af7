-- sliding_counter: the events of the last `windows` sub-windows of
-- period / windows each (the current one included) add up to at most limit.
--
-- KEYS[1] -> hash: sub-window index (now µs // sub-window µs) -> events admitted in it
-- ARGV    -> now, limit, period, burst (unused), windows, n, ttl slack (see prelude)
-- Output  -> {allowed (1|0), remaining, retry_after µs, reset_after µs}

local key = KEYS[1]
local sub = period / windows -- whole: the caller checks that windows divides period
local current = floordiv(now, sub)
local fields = redis.call('HGETALL', key)
local total, newest, live, stale = 0, nil, {}, {} -- newest: the latest sub-window counted
for i = 1, #fields, 2 do
  local index, count = tonumber(fields[i]), tonumber(fields[i + 1])
  if index <= current - windows then
    stale[#stale + 1] = fields[i]
  else
    total = total + count
    newest = math.max(newest or index, index)
    live[#live + 1] = {index, count}
  end
end
if #stale > 0 then redis.call('HDEL', key, unpack(stale)) end

if total + n > limit then
  -- The call fits once enough of the oldest sub-windows have slid out;
  -- sub-window i slides out at (i + windows) * sub.
  table.sort(live, function(a, b) return a[1] < b[1] end)
  local need, freed, retry = total + n - limit, 0, 0
  for _, entry in ipairs(live) do
    freed = freed + entry[2]
    if freed >= need then
      retry = (entry[1] + windows) * sub - now
      break
    end
  end
  return {0, math.max(0, limit - total), retry, (newest + windows) * sub - now}
end

redis.call('HINCRBY', key, int(current), n)
newest = math.max(newest or current, current)
keep_for(key, (newest + windows) * sub - now)
return {1, limit - total - n, 0, (newest + windows) * sub - now}
