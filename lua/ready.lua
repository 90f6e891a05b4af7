-- ready: moves tasks that waited in asynq's retry or scheduled list to the
-- head of their queue's pending list, where a worker takes them next.
-- asynq's own forwarder (and Inspector.RunTask) put them at the tail, behind
-- the queue's whole backlog: a task back for its turn would be taken only
-- after every task enqueued before it, late. This writes asynq's keys as
-- asynq v0.26 lays them out (internal/base): the queue's lists, and per task
-- a hash whose field state names the list it is in; the tests pin it.
--
-- KEYS[1] -> the queue's pending list (asynq takes its right end first)
-- KEYS[2] -> the queue's retry sorted set
-- KEYS[3] -> the queue's scheduled sorted set
-- ARGV[1] -> the queue's task key prefix (the task's hash is prefix .. id)
-- ARGV[2] -> now in ns (asynq's pending_since)
-- ARGV[3...] -> task ids
-- Output  -> per id: 1 moved; 2 still active (asynq has not moved it to
--            its retry list yet); 0 neither (gone, pending, or archived)

-- A task back from waiting is in the retry list (asynq's retry path) or
-- the scheduled one (a copy): removing it from its list is the test, and
-- its state is read only if it is in neither.
local out, moved = {}, {}
for i = 3, #ARGV do
  local id = ARGV[i]
  local key = ARGV[1] .. id
  local result = 0
  if redis.call('ZREM', KEYS[2], id) == 1 or redis.call('ZREM', KEYS[3], id) == 1 then
    moved[#moved + 1] = id
    redis.call('HSET', key, 'state', 'pending', 'pending_since', ARGV[2])
    result = 1
  elseif redis.call('HGET', key, 'state') == 'active' then
    result = 2
  end
  out[#out + 1] = result
end
-- The earliest due at the right end, which asynq takes first: a worker
-- short of free slots takes them in the order they are due. One RPUSH
-- per 100 tasks.
local n = #moved
for i = 1, n, 100 do
  local chunk = {}
  for j = i, math.min(i + 99, n) do chunk[#chunk + 1] = moved[n + 1 - j] end
  redis.call('RPUSH', KEYS[1], unpack(chunk))
end
return out
