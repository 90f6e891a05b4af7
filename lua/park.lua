-- park: takes a batch of a queue's pending tasks out of the pending list to
-- wait in Redis for their turns, before they are booked, so that no worker
-- takes one meanwhile: a task taken, refused and sent back costs asynq's
-- dequeue and retry script runs on top of its booking. Each moved task rests
-- in asynq's retry set, marked as waiting, not failed, due back after a
-- while (asynq's own fallback, should the worker that parks it die before
-- its booking says when it is due: that worker then notes it in the wake set
-- and moves its retry time). This writes asynq's keys as asynq v0.26 lays
-- them out (internal/base), as ready.lua does; the tests pin it.
--
-- KEYS[1] -> the queue's pending list (asynq takes its right end first)
-- KEYS[2] -> the queue's retry sorted set
-- ARGV[1] -> the queue's task key prefix (the task's hash is prefix .. id)
-- ARGV[2] -> in how many µs asynq may bring the first moved task back itself
-- ARGV[3] -> bytes appended to each moved task's message: its last error,
--            a wait's (a later field of a protobuf message wins)
-- ARGV[4] -> µs later for each task after the first
-- ARGV[5...] -> task ids
-- Output -> per task: 1 moved, 0 no longer pending (a worker took it)

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local first, pace = tonumber(ARGV[2]), tonumber(ARGV[4])
local out, due = {}, {}
for i = 5, #ARGV do
  local id = ARGV[i]
  local key = ARGV[1] .. id
  local msg = redis.call('HGET', key, 'msg')
  local moved = 0
  -- From the right end, where asynq takes tasks and the batch was read.
  if msg and redis.call('LREM', KEYS[1], -1, id) == 1 then
    due[#due + 1], due[#due + 2] = math.floor((now + first + (i - 5) * pace) / 1000000), id
    redis.call('HSET', key, 'state', 'retry', 'msg', msg .. ARGV[3])
    moved = 1
  end
  out[#out + 1] = moved
end
-- One ZADD for them all (pairs of score and id), not one per task.
for i = 1, #due, 200 do
  redis.call('ZADD', KEYS[2], unpack(due, i, math.min(i + 199, #due)))
end
return out
