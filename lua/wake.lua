-- wake: the tasks of one queue that wait in Redis for their turn, by when
-- they should be pending again. asynq moves a scheduled task to pending
-- once the second it is scheduled in has begun, up to a second early; the
-- workers ask this set, which keeps µs, and move each task themselves.
--
-- KEYS[1] -> sorted set: task id -> µs when it should be pending
-- ARGV[1] -> now in µs, or '' to read Redis TIME
-- ARGV[2] -> the most ids to take
-- Output  -> {µs until the next one is due (-1: none left), ids due...};
--            the ids are taken out of the set

local now = clock()
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[2]))
for i = 1, #due, 100 do
  redis.call('ZREM', KEYS[1], unpack(due, i, math.min(i + 99, #due)))
end
local next_ = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
local reply = {-1}
if next_[2] then reply[1] = math.max(0, tonumber(next_[2]) - now) end
for _, id in ipairs(due) do reply[#reply + 1] = id end
return reply
