-- Common to every sluice script (lua.go puts it in front of each one).
-- The scripts need Redis 6.0 or later (SET ... KEEPTTL; effects
-- replication, the default since 5.0, lets them write after reading TIME).
--
-- The hot paths write a state with PSETEX, SET ... PX with one argument
-- fewer for the server to read.
--
-- All times are integer microseconds. A Unix time in µs is below 2^53, so
-- Lua's doubles hold it, and every product the scripts form, exactly.
-- Redis formats a number passed to redis.call exactly (%.17g), but Lua's
-- own conversion to a string keeps 14 digits: a number that becomes part
-- of a string goes through int(), or string.format's %d (64 bits), which
-- formats several at once.

local function int(x)
  return string.format('%.0f', x)
end

-- floordiv and ceildiv divide an integer by a positive integer exactly
-- (a may be negative). Lua 5.1's a % b is a - floor(a / b) * b, and a / b
-- is rounded, so the remainder may be off by b: it is mended, and then
-- a - r is a multiple of b whose quotient a division gives exactly. (No
-- math.floor: a call of a C function costs more than the rest of this.)
local function floordiv(a, b)
  local r = a % b
  if r < 0 then r = r + b elseif r >= b then r = r - b end
  return (a - r) / b
end

local function ceildiv(a, b)
  local r = a % b
  if r < 0 then r = r + b elseif r >= b then r = r - b end
  if r == 0 then return a / b end
  return (a - r) / b + 1
end

-- One assignment at a time: miniredis's Lua (gopher-lua) assigns a before
-- it reads a for b in "a, b = b, a % b", so that gcd(4, 100000) was 100000
-- there (a bucket's every event then took 1/25,000 of its time).
local function gcd(a, b)
  while b ~= 0 do
    local r = a - floordiv(a, b) * b
    a = b
    b = r
  end
  return a
end

-- nums returns the integers of a string "a b c ...", as the scripts write
-- their states.
local function nums(s)
  local v = {}
  for x in string.gmatch(s, '%-?%d+') do v[#v + 1] = tonumber(x) end
  return v
end

-- list_nums returns the integers of a state written by list_text, "a,b,c"
-- (a JSON array's inside, which cjson reads in C: about a third of nums'
-- instructions), or of one written as nums reads it, as states were before.
local function list_nums(s)
  if string.find(s, ' ', 1, true) then return nums(s) end
  return cjson.decode('[' .. s .. ']')
end

-- ARGV[1] is the caller's clock when one was injected, '' otherwise: then
-- Redis's own clock decides, so that no two workers disagree about time.
-- (Lua reads a string in arithmetic as the number it holds, exactly:
-- cheaper than tonumber, a call of a C function.)
local function clock()
  if ARGV[1] ~= '' then return ARGV[1] + 0 end
  local t = redis.call('TIME')
  return t[1] * 1000000 + t[2]
end

-- A key's recent throttles ("recent"): a ring "b c b c ..." of how many
-- events were throttled in each RECENT_STEP of time (b: now // step), the
-- last RECENT_STEPS steps kept, so that the last minute is in it whatever
-- the phase. Readers (throttle.RecentThrottled) sum the steps that overlap
-- the last minute.
local RECENT_STEP = 10000000 -- µs
local RECENT_STEPS = 7
local RECENT_LIFE = RECENT_STEP * RECENT_STEPS / 1000 -- ms

-- recent_add returns ring (nil: empty) with n more throttled at now, the
-- steps too old to matter dropped.
local function recent_add(ring, now, n)
  local b = floordiv(now, RECENT_STEP)
  local out, added = {}, false
  if ring then
    local v = nums(ring)
    for i = 1, #v - 1, 2 do
      if v[i] > b - RECENT_STEPS then
        local c = v[i + 1]
        if v[i] == b then c, added = c + n, true end
        out[#out + 1] = string.format('%d %d', v[i], c)
      end
    end
  end
  if not added then out[#out + 1] = string.format('%d %d', b, n) end
  return table.concat(out, ' ')
end

-- recent_note counts n events throttled at now in the ring kept at key (a
-- string), which lives as long as the ring matters.
local function recent_note(key, now, n)
  redis.call('SET', key, recent_add(redis.call('GET', key), now, n), 'PX', RECENT_LIFE)
end

-- recent_note_in counts n events throttled at now for field, in the hash
-- at key that keeps the rings of many key values (one slot's): at most
-- RECENT_FIELDS of them. Once per RECENT_LIFE the rings of fields quiet
-- that long are swept out; a new field that finds the hash full is not
-- counted.
local RECENT_FIELDS = 10000
local RECENT_SWEPT = '%swept' -- no escaped key value is this (keys.go)
local function recent_note_in(key, field, now, n)
  local ring = redis.call('HGET', key, field)
  if not ring then
    local swept = tonumber(redis.call('HGET', key, RECENT_SWEPT) or 0)
    if now - swept > RECENT_LIFE * 1000 then
      local all = redis.call('HGETALL', key)
      local oldest = floordiv(now, RECENT_STEP) - RECENT_STEPS
      for i = 1, #all - 1, 2 do
        if all[i] ~= RECENT_SWEPT then
          local v = nums(all[i + 1])
          if (v[#v - 1] or oldest) <= oldest then redis.call('HDEL', key, all[i]) end
        end
      end
      redis.call('HSET', key, RECENT_SWEPT, int(now))
    end
    if redis.call('HLEN', key) > RECENT_FIELDS then return end
  end
  redis.call('HSET', key, field, recent_add(ring, now, n))
  redis.call('PEXPIRE', key, RECENT_LIFE)
end
