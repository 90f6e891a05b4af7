-- book_buckets: book.lua's book on two buckets in one slot with
-- nothing else asked (no ID, nothing to give back, no replaced limit, no
-- recent throttles, no fair share, no remind, not exact), which is a
-- drain's and a quota's booking: bucket.lua's quick steps for each claim,
-- and book.lua itself (book()) when any state is not one they read. A
-- function of the library only (lua.go): scripts run book.lua.
--
-- KEYS[1], KEYS[2] -> the claims' state keys (aux keys: KEYS[i] .. ':b')
-- ARGV[1] -> now in µs, or '' to read Redis TIME
-- ARGV[2] -> the call's numbers and texts, packed (struct's '<'): twelve
--            doubles: now (µs; any value where ARGV[1] is ''), claim 1's
--            and then claim 2's period/g, and burst and n in units of
--            1/(limit/g) µs, g = gcd(limit, period), the TTL slack (µs),
--            added to every TTL, the longest wait (µs; 0 counts now or
--            never), not before (µs), claim 1's and claim 2's limit/g; then
--            claim 1's and claim 2's n in units as zero-terminated text,
--            which the state of an empty bucket booked at now is written
--            from (with ARGV[1]), no number formatted
-- Output  -> book.lua's; a booking's claims without retry_after (0) and
--            with their pieces as two integers each, ref and from, not
--            the string "ref from to" (to is from + n, in units):
--            {1, now, at, then per claim remaining, reset_after, ref, from};
--            where both buckets were empty and are booked at now, {1, now,
--            at, then per claim remaining, reset_after} (refs now, froms 0)
--
-- Two claims in locals, not a table each: reading a table's fields cost
-- more than the rest of the decision.

local BOOK_PASSES = 16 -- settle.lua's MAX_PASSES
-- One argument, read in one call of struct.unpack: each argument costs the
-- server its own place in ARGV, and each number sent as text a conversion
-- (strtod), about 1,500 instructions a number.
local now, pe1, w1, n1, pe2, w2, n2, slack, max_wait, start, pm1, pm2, need1, need2 =
  struct.unpack('<ddddddddddddss', ARGV[2])
if ARGV[1] == '' then now = clock() end
if start < now then start = now end

local r1, s1, e1, c1, h1, m1, st1 = bucket_read(KEYS[1], now, pm1)
if not r1 then return book_buckets_slow(now, start, max_wait, slack, {pe1, w1, n1, pm1}, {pe2, w2, n2, pm2}) end
local r2, s2, e2, c2, h2, m2, st2 = bucket_read(KEYS[2], now, pm2)
if not r2 then return book_buckets_slow(now, start, max_wait, slack, {pe1, w1, n1, pm1}, {pe2, w2, n2, pm2}) end

-- As book.lua: each claim alone, then the earliest instant at which both fit.
local own1, own2 = start, start
if start - now <= max_wait then
  if c1 == 1 then own1 = bucket_earliest(r1, s1, e1, c1, pm1, w1, n1, start) end
  if c2 == 1 then own2 = bucket_earliest(r2, s2, e2, c2, pm2, w2, n2, start) end
end
local at = own1
if own2 > at then at = own2 end
-- Where both own turns are one instant, it is the turn (each claim's
-- earliest from its own turn is that turn). Otherwise settle.lua's loop,
-- on the two buckets' states as read, without their constructors' objects.
local settled, pass = own1 == own2, 0
while not settled and pass < BOOK_PASSES and at - now <= max_wait do
  local next_ = bucket_earliest(r1, s1, e1, c1, pm1, w1, n1, at)
  if next_ - now <= max_wait then next_ = bucket_earliest(r2, s2, e2, c2, pm2, w2, n2, next_) end
  if next_ == at then
    settled = true
    break
  end
  at, pass = next_, pass + 1
end

if not settled or at - now > max_wait then
  local room1, room2 = 0, 0
  if start == now then
    room1 = bucket_room(r1, s1, e1, c1, pm1, pe1, w1, now)
    room2 = bucket_room(r2, s2, e2, c2, pm2, pe2, w2, now)
  end
  bucket_trimmed(KEYS[1], r1, c1, st1, slack)
  bucket_trimmed(KEYS[2], r2, c2, st2, slack)
  return {0, now, at, room1, own1 - now, math.max(start - now, bucket_reset(r1, e1, c1, pm1, now)), '',
    room2, own2 - now, math.max(start - now, bucket_reset(r2, e2, c2, pm2, now)), ''}
end
-- Booked past the one span's end or before its start: two spans.
local y1, y2 = (at - r1) * pm1, (at - r2) * pm2
if c1 == 1 and (y1 < s1 or y1 > e1) or c2 == 1 and (y2 < s2 or y2 > e2) then return book_buckets_slow(now, start, max_wait, slack, {pe1, w1, n1, pm1}, {pe2, w2, n2, pm2}) end
local from1, from2 = y1, y2
if c1 == 1 then from1 = e1 end
if c2 == 1 then from2 = e2 end
s1, e1 = bucket_write(KEYS[1], r1, s1, e1, c1, h1, m1, pm1, n1, y1, now, slack, ARGV[1], need1)
s2, e2 = bucket_write(KEYS[2], r2, s2, e2, c2, h2, m2, pm2, n2, y2, now, slack, ARGV[1], need2)
-- bucket_room and bucket_reset at at, inline (booked at the end of the
-- one span: it starts at or before y and ends at e); in µs, no division,
-- where limit/g is 1.
local z1, z2 = y1 + w1, y2 + w2 -- the window's end, then what is taken in it
if z1 > e1 then z1 = e1 end
if z2 > e2 then z2 = e2 end
if y1 > s1 then z1 = z1 - y1 else z1 = z1 - s1 end
if y2 > s2 then z2 = z2 - y2 else z2 = z2 - s2 end
if z1 < 0 then z1 = 0 end
if z2 < 0 then z2 = 0 end
local reset1, reset2 = e1 - y1, e2 - y2
if pm1 ~= 1 then reset1 = ceildiv(reset1, pm1) end
if pm2 ~= 1 then reset2 = ceildiv(reset2, pm2) end
-- floordiv(w - z, pe) inline: a call of a Lua function costs more than
-- these steps.
local left1, left2 = w1 - z1, w2 - z2
local q1, q2 = left1 % pe1, left2 % pe2
if q1 < 0 then q1 = q1 + pe1 elseif q1 >= pe1 then q1 = q1 - pe1 end
if q2 < 0 then q2 = q2 + pe2 elseif q2 >= pe2 then q2 = q2 - pe2 end
left1, left2 = (left1 - q1) / pe1, (left2 - q2) / pe2
if c1 == 0 and c2 == 0 and at == now then -- refs now and froms 0: four values fewer
  return {1, now, at, left1, reset1, left2, reset2}
end
return {1, now, at, left1, at - now + reset1, r1, from1, left2, at - now + reset2, r2, from2}
