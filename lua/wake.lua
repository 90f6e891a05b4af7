-- wake: the tasks of one queue that wait in Redis for their turn, by when
-- they should be pending again. asynq moves a scheduled task to pending
-- once the second it is scheduled in has begun, up to a second early; the
-- workers note here, in µs on Redis's clock, when each task is due, and one
-- of them at a time (the waker, on a lease) takes the tasks due and moves
-- each to pending.
--
-- A queue with fair shares has lines too (see fair.lua): a task its key
-- may not book for now waits in its key's line (park), and each take lets
-- out of every line as many tasks as their key's share has room for.
--
-- KEYS[1] -> sorted set: task id -> µs when it should be pending
-- KEYS[2] -> string: the waker, for as long as its lease lasts
-- KEYS[3..6] -> a fair queue's state, aux, lines and keys (fair.lua)
-- KEYS[7] -> a fair queue's recent throttles by key value (common.lua's
--            recent_note_in): each park counts
-- ARGV[1] -> now in µs, or '' to read Redis TIME
-- ARGV[2] -> op: note, take, resign, rush or park
-- note:   ARGV[3] -> a task id, ARGV[4] -> in how many µs it is due, or
--         '@' and the µs it is due at (no TIME read then); the set needs
--         no TTL: taken empty, it is gone
-- take:   ARGV[3] -> the most ids to take, ARGV[4] -> µs ahead: tasks due
--         that soon are taken too, ARGV[5] -> the worker taking,
--         ARGV[6] -> the waker's lease in µs, taken if no worker holds
--         it, renewed by each take; negative: the caller holds the lease
--         and it has life left: neither read nor renewed (a GET and a SET
--         less per look; should it have passed to another worker, both
--         take for a moment, each task once, until the caller's next
--         renewal finds it out). ARGV[1] may be the caller's reckoning of
--         Redis's clock, corrected by the now of an earlier reply (a TIME
--         less per look)
-- resign: ARGV[3] -> the worker that no longer takes
-- rush:   every task is due now (the limits changed: their turns are void)
-- take, on the queues' server: KEYS[3..5] -> the queue's pending list,
--         retry and scheduled sets, ARGV[7] -> its task key prefix,
--         ARGV[8] -> now in ns (asynq's pending_since), ARGV[9], ARGV[10]
--         -> see below
-- take, fair: ARGV[7] -> the depth shared (fair.lua), ARGV[8] -> the most
--         keys looked at, ARGV[9], ARGV[10] -> the drain's limit and period
--         (µs)
-- park:   ARGV[3] -> a task id, ARGV[4] -> its booking id, ARGV[5] -> its
--         key value (as fair.lua names it), ARGV[6] -> its weight,
--         ARGV[7] -> its cost, ARGV[8], ARGV[9] -> the drain's limit and
--         period (µs), ARGV[10] -> '1': not if the task was let out of its
--         line (it books), ARGV[11] -> '1': only the estimate, the task is
--         not put in the line
-- Output  -> park: about how many µs until its key's share lets it out
--            (if every active key stays backlogged), -1 if it was let out;
--            note: 1; take: {1 if tasks wait in fair lines, else 0, now,
--            then per task taken its id and µs since it was due (negative:
--            due yet)}, or {-2, µs until the waker's lease ends} when
--            another worker is the waker; resign: 1 if it was the waker;
--            rush: how many

local op = ARGV[2]
if op == 'note' then
  local at = ARGV[4]
  if string.sub(at, 1, 1) == '@' then at = tonumber(string.sub(at, 2)) else at = clock() + tonumber(at) end
  redis.call('ZADD', KEYS[1], at, ARGV[3])
  return 1
end
local now = clock()
local fair = #KEYS >= 6
-- fair_life keeps a fair queue's lines as long as what waits in them.
local FAIR_LIFE = 3600 * 1000
if op == 'park' then
  local state, aux, lines, keys = KEYS[3], KEYS[4], KEYS[5], KEYS[6]
  local id, booking, m = ARGV[3], ARGV[4], ARGV[5]
  local weight, n = tonumber(ARGV[6]), tonumber(ARGV[7])
  fair_trim(state, aux, now, fair_lead(tonumber(ARGV[8]), tonumber(ARGV[9])))
  -- A task let out of its line must book, not wait again (a worker that
  -- saw its key refused a moment ago would send it back to the line).
  if ARGV[10] == '1' and redis.call('ZSCORE', aux, string.format('r %s %d %s', m, n, booking)) then
    return -1
  end
  -- The wait: the tasks ahead in its line and itself, at its key's share
  -- of the drain if every active key stays backlogged.
  local function estimate(waiting, W)
    local share = math.floor(waiting * n * W * tonumber(ARGV[9]) / (tonumber(ARGV[8]) * weight))
    return math.max(share, fair_num(state, 'b:' .. m) - now)
  end
  if ARGV[11] == '1' then
    local W = fair_num(state, 'W') - fair_num(state, 'w:' .. m) + weight
    return estimate(fair_num(state, 'p:' .. m) + 1, W)
  end
  local seq = redis.call('HINCRBY', state, 's', 1)
  redis.call('ZADD', lines, 0, string.format('%s %015d %d %d %s%s', m, seq, n, #id, id, booking))
  local waiting = redis.call('HINCRBY', state, 'p:' .. m, 1)
  if KEYS[7] then recent_note_in(KEYS[7], m, now, n) end
  -- A key that waits for its own limits (fair.lua's b:<m>) asks nothing of
  -- the drain now: its weight does not count against the others' shares.
  if fair_num(state, 'b:' .. m) <= now then fair_touch(state, m, weight) end
  redis.call('ZADD', keys, 'NX', now, m)
  for _, key in ipairs({state, lines, keys}) do fair_keep(key, FAIR_LIFE) end
  return estimate(waiting, fair_num(state, 'W'))
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

local lease = tonumber(ARGV[6])
if lease > 0 then
  local waker = redis.call('GET', KEYS[2])
  if waker and waker ~= ARGV[5] then
    return {-2, redis.call('PTTL', KEYS[2]) * 1000}
  end
  redis.call('SET', KEYS[2], ARGV[5], 'PX', ceildiv(lease, 1000))
end
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now + tonumber(ARGV[4]), 'WITHSCORES', 'LIMIT', 0, tonumber(ARGV[3]))
local ids, reply = {}, {0, now}
for i = 1, #due, 2 do
  ids[#ids + 1] = due[i]
  reply[#reply + 1], reply[#reply + 2] = due[i], now - tonumber(due[i + 1])
end
for i = 1, #ids, 100 do
  redis.call('ZREM', KEYS[1], unpack(ids, i, math.min(i + 99, #ids)))
end
-- A waker whose queue's asynq keys are on this server (KEYS[3..5]) moves
-- the tasks it takes to the head of pending in the same run, as ready.lua
-- does, and each task's pair in the reply is its id and 1 if moved, 2 if
-- asynq still has it as active (noted again ARGV[9] µs later, up to ARGV[10]
-- µs after it was due), 0 if neither.
if #KEYS == 5 then
  local prefix, ns, again, still = ARGV[7], ARGV[8], tonumber(ARGV[9]), tonumber(ARGV[10])
  local moved = {}
  for i = 3, #reply, 2 do
    local id, overdue = reply[i], reply[i + 1]
    local key = prefix .. id
    local result = 0
    if redis.call('ZREM', KEYS[4], id) == 1 or redis.call('ZREM', KEYS[5], id) == 1 then
      moved[#moved + 1] = id
      redis.call('HSET', key, 'state', 'pending', 'pending_since', ns)
      result = 1
    elseif redis.call('HGET', key, 'state') == 'active' then
      result = 2
      if overdue < still then redis.call('ZADD', KEYS[1], now + again, id) end
    end
    reply[i + 1] = result
  end
  -- The earliest due at the right end, which asynq takes first: a worker
  -- short of free slots takes them in the order they are due. One RPUSH
  -- per 100 tasks.
  local n = #moved
  for i = 1, n, 100 do
    local chunk = {}
    for j = i, math.min(i + 99, n) do chunk[#chunk + 1] = moved[n + 1 - j] end
    redis.call('RPUSH', KEYS[3], unpack(chunk))
  end
end

-- Fair lines: each key with tasks waiting lets out as many as its share
-- has room for, oldest first; what a task let out will book is held for
-- it (a release) until it books or the release passes.
local RELEASE_LIFE = 2000000 -- µs a task let out has to book
if fair then
  local state, aux, lines, keys = KEYS[3], KEYS[4], KEYS[5], KEYS[6]
  local depth, most = tonumber(ARGV[7]), tonumber(ARGV[8])
  fair_trim(state, aux, now, fair_lead(tonumber(ARGV[9]), tonumber(ARGV[10])))
  local room = tonumber(ARGV[3]) - #ids
  for _, m in ipairs(redis.call('ZRANGE', keys, 0, most - 1)) do
    if room <= 0 then break end
    local w = fair_num(state, 'w:' .. m)
    local let = 0
    -- A key paced by its own limits waits for its turn to be in reach.
    local reach = fair_num(state, 'b:' .. m)
    while room > 0 and reach <= now do
      local first = redis.call('ZRANGEBYLEX', lines, '[' .. m .. ' ', '(' .. m .. '!', 'LIMIT', 0, 1)[1]
      if not first then break end
      local n, len, rest = string.match(first, '^%S+ %d+ (%d+) (%d+) (.*)$')
      n, len = tonumber(n), tonumber(len)
      if not fair_fits(state, m, math.max(w, 1), depth, n) then break end
      redis.call('ZREM', lines, first)
      local id, booking = string.sub(rest, 1, len), string.sub(rest, len + 1)
      redis.call('ZADD', aux, now + RELEASE_LIFE, string.format('r %s %d %s', m, n, booking))
      redis.call('HINCRBY', state, 'c:' .. m, n)
      redis.call('HINCRBY', state, 'p:' .. m, -1)
      reply[#reply + 1], reply[#reply + 2] = id, 0
      room, let = room - 1, let + 1
    end
    if not redis.call('ZRANGEBYLEX', lines, '[' .. m .. ' ', '(' .. m .. '!', 'LIMIT', 0, 1)[1] then
      redis.call('ZREM', keys, m)
      fair_settle(state, m)
    elseif let > 0 then
      redis.call('ZADD', keys, now, m) -- served: to the back of the round
    end
  end
  fair_keep(aux, RELEASE_LIFE / 1000 + 1000)
end
-- Lines wait on shares, not on time: the waker looks again soon.
if fair and redis.call('ZCARD', KEYS[6]) > 0 then reply[1] = 1 end
return reply
