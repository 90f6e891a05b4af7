-- park: moves a batch of a queue's pending tasks into the backlog lines
-- their gates have, in one run, without a worker taking each: a task behind
-- a line would be taken, refused its turn and sent back to Redis (three
-- script runs) only to take a ticket there. Each parked task gets the next
-- ticket of its line, is noted in the wake set requeue-lead before it, and
-- rests in asynq's retry set (asynq's own fallback, a second after the
-- ticket), marked as waiting, not failed. This writes asynq's keys as asynq
-- v0.26 lays them out (internal/base), as ready.lua does; the tests pin it.
--
-- KEYS[1] -> the queue's pending list (asynq takes its right end first)
-- KEYS[2] -> the queue's retry sorted set
-- KEYS[3] -> the queue's wake set (wake.lua)
-- KEYS[4] -> the queue's furthest line tail (member 't'), as joinLine keeps it
-- KEYS[5...] -> the lines the tasks go to (member 't': µs after the last
--               ticket, on Redis's clock)
-- ARGV[1] -> the queue's task key prefix (the task's hash is prefix .. id)
-- ARGV[2] -> requeue lead in µs: a task is due back this long before its ticket
-- ARGV[3] -> how long a line is kept after its last ticket, in ms
-- ARGV[4] -> bytes appended to each parked task's message: its last error,
--            a wait's (a later field of a protobuf message wins)
-- ARGV[5 .. 4+#lines] -> each line's interval between tickets in µs
-- then pairs: a task id, the index (1-based) of its line in KEYS[5...]
-- Output -> per task: its ticket in µs, or 0 if it was no longer pending
--           (a worker took it meanwhile)

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local nlines = #KEYS - 4
local interval, used = {}, {}
for i = 1, nlines do
  interval[i] = tonumber(ARGV[4 + i])
end
local out = {}
for i = 5 + nlines, #ARGV, 2 do
  local id, line = ARGV[i], tonumber(ARGV[i + 1])
  local ticket = 0
  local key = ARGV[1] .. id
  local msg = redis.call('HGET', key, 'msg')
  -- From the right end, where asynq takes tasks and the batch was read.
  if msg and redis.call('LREM', KEYS[1], -1, id) == 1 then
    if not used[line] then
      -- A line whose tail has passed starts now: no ticket in the past.
      redis.call('ZADD', KEYS[4 + line], 'GT', now, 't')
    end
    local tail = tonumber(redis.call('ZINCRBY', KEYS[4 + line], interval[line], 't'))
    ticket = tail - interval[line]
    used[line] = tail
    redis.call('ZADD', KEYS[3], ticket - tonumber(ARGV[2]), id)
    -- asynq counts in whole seconds: its fallback comes after the waker.
    redis.call('ZADD', KEYS[2], math.floor(ticket / 1000000) + 2, id)
    redis.call('HSET', key, 'state', 'retry', 'msg', msg .. ARGV[4])
  end
  out[#out + 1] = ticket
end
for line, tail in pairs(used) do
  local life = math.floor((tail - now) / 1000) + tonumber(ARGV[3])
  redis.call('PEXPIRE', KEYS[4 + line], life)
  redis.call('ZADD', KEYS[4], 'GT', tail, 't')
  if redis.call('PTTL', KEYS[4]) < life then
    redis.call('PEXPIRE', KEYS[4], life)
  end
end
return out
