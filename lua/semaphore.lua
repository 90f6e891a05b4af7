-- semaphore: at most limit holders at once, fleet-wide. A holder's lease
-- ends at its score unless renewed, so the slots of a worker that died come
-- back by themselves.
--
-- KEYS[1] -> sorted set: holder -> µs its lease ends
-- KEYS[2] -> optional: where refused acquires are counted (common.lua's
--            recent_note), in the same slot
-- ARGV[1] -> now in µs, or '' to read Redis TIME
-- ARGV[2] -> op: acquire, renew or release
-- ARGV[3] -> holder
-- ARGV[4] -> limit (acquire, renew)
-- ARGV[5] -> lease µs (acquire, renew)
-- Output  -> {1 held | 0 not held, holders now, µs until the first lease ends
--            (0 when held), 1 if renew found the holder's lease ended | 0}
--
-- A renew whose lease has ended takes a free slot again, as acquire would:
-- its holder ran uncounted meanwhile, and is counted again from now. The
-- reply says the lease had ended, so that the holder can tell (and stop if
-- no slot was free).

local key, op, holder = KEYS[1], ARGV[2], ARGV[3]
local now = clock()
redis.call('ZREMRANGEBYSCORE', key, '-inf', int(now))

if op == 'release' then
  redis.call('ZREM', key, holder)
  return {0, redis.call('ZCARD', key), 0, 0}
end

local lease = tonumber(ARGV[5])
local held = redis.call('ZSCORE', key, holder)
local lapsed = 0
if op == 'renew' and not held then lapsed = 1 end
local count = redis.call('ZCARD', key)
if not held and count < tonumber(ARGV[4]) then
  held, count = true, count + 1
end
if not held then
  if op == 'acquire' and KEYS[2] then recent_note(KEYS[2], now, 1) end
  local first = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')[2]
  return {0, count, first and (tonumber(first) - now) or 0, lapsed}
end
redis.call('ZADD', key, int(now + lease), holder)
-- The newest lease is the last to end: the key lives as long as it.
redis.call('PEXPIRE', key, ceildiv(lease, 1000))
return {1, count, 0, lapsed}
