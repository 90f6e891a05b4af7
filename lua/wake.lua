-- wake: the tasks of one queue that wait in Redis for their turn, by when
-- they should be pending again. asynq moves a scheduled task to pending
-- once the second it is scheduled in has begun, up to a second early; the
-- workers note here, in µs on Redis's clock, when each task is due, take
-- the tasks due and move each to pending themselves.
--
-- KEYS[1] -> sorted set: task id -> µs when it should be pending
-- ARGV[1] -> now in µs, or '' to read Redis TIME
-- ARGV[2] -> op: note or take
-- note: ARGV[3] -> a task id, ARGV[4] -> in how many µs it is due;
--       the set lives until a minute after its last task is due
-- take: ARGV[3] -> the most ids to take
-- rush: every task is due now (the limits changed: their turns are void)
-- Output  -> note: 1; take: {µs until the next one is due (-1: none left),
--            ids due...}, the ids taken out of the set; rush: how many

local now = clock()
if ARGV[2] == 'note' then
  local due = now + tonumber(ARGV[4])
  redis.call('ZADD', KEYS[1], due, ARGV[3])
  local last = tonumber(redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')[2])
  redis.call('PEXPIRE', KEYS[1], ceildiv(last - now + 60000000, 1000))
  return 1
end
if ARGV[2] == 'rush' then
  local all = redis.call('ZRANGE', KEYS[1], 0, -1)
  for _, id in ipairs(all) do redis.call('ZADD', KEYS[1], now, id) end
  return #all
end
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[3]))
for i = 1, #due, 100 do
  redis.call('ZREM', KEYS[1], unpack(due, i, math.min(i + 99, #due)))
end
local next_ = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
local reply = {-1}
if next_[2] then reply[1] = math.max(0, tonumber(next_[2]) - now) end
for _, id in ipairs(due) do reply[#reply + 1] = id end
return reply
