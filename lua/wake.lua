-- wake: the tasks of one queue that wait in Redis for their turn, by when
-- they should be pending again. asynq moves a scheduled task to pending
-- once the second it is scheduled in has begun, up to a second early; the
-- workers note here, in µs on Redis's clock, when each task is due, and one
-- of them at a time (the waker, on a lease) takes the tasks due and moves
-- each to pending.
--
-- KEYS[1] -> sorted set: task id -> µs when it should be pending
-- KEYS[2] -> string: the waker, for as long as its lease lasts
-- ARGV[1] -> now in µs, or '' to read Redis TIME
-- ARGV[2] -> op: note, take, resign or rush
-- note:   ARGV[3] -> a task id, ARGV[4] -> in how many µs it is due
--         (the set needs no TTL: taken empty, it is gone)
-- take:   ARGV[3] -> the most ids to take, ARGV[4] -> µs ahead: tasks due
--         that soon are taken too, ARGV[5] -> the worker taking,
--         ARGV[6] -> the waker's lease in µs, renewed by each take
-- resign: ARGV[3] -> the worker that no longer takes
-- rush:   every task is due now (the limits changed: their turns are void)
-- Output  -> note: 1; take: {µs until a task is due (-1: none left), then
--            per task taken its id and µs since it was due (negative: due
--            yet)}, or {-2, µs until the waker's lease ends} when another
--            worker is the waker; resign: 1 if it was the waker; rush: how
--            many

local now = clock()
local op = ARGV[2]
if op == 'note' then
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[4]), ARGV[3])
  return 1
end
if op == 'rush' then
  local all = redis.call('ZRANGE', KEYS[1], 0, -1)
  for _, id in ipairs(all) do redis.call('ZADD', KEYS[1], now, id) end
  return #all
end
if op == 'resign' then
  if redis.call('GET', KEYS[2]) == ARGV[3] then
    redis.call('DEL', KEYS[2])
    return 1
  end
  return 0
end

local waker = redis.call('GET', KEYS[2])
if waker and waker ~= ARGV[5] then
  return {-2, redis.call('PTTL', KEYS[2]) * 1000}
end
redis.call('SET', KEYS[2], ARGV[5], 'PX', ceildiv(tonumber(ARGV[6]), 1000))
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now + tonumber(ARGV[4]), 'WITHSCORES', 'LIMIT', 0, tonumber(ARGV[3]))
local ids, reply = {}, {-1}
for i = 1, #due, 2 do
  ids[#ids + 1] = due[i]
  reply[#reply + 1], reply[#reply + 2] = due[i], now - tonumber(due[i + 1])
end
for i = 1, #ids, 100 do
  redis.call('ZREM', KEYS[1], unpack(ids, i, math.min(i + 99, #ids)))
end
local next_ = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
if next_[2] then reply[1] = math.max(0, tonumber(next_[2]) - now) end
return reply
