-- Common to every sluice script (lua.go puts it in front of each one).
-- The scripts need Redis 6.0 or later (SET ... KEEPTTL; effects
-- replication, the default since 5.0, lets them write after reading TIME).
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
-- (a may be negative): a / b is rounded, so the remainder is checked and the
-- quotient mended.
local function floordiv(a, b)
  local q = math.floor(a / b)
  local r = a - q * b
  if r < 0 then return q - 1 end
  if r >= b then return q + 1 end
  return q
end

local function ceildiv(a, b)
  return -floordiv(-a, b)
end

local function gcd(a, b)
  while b ~= 0 do
    a, b = b, a - floordiv(a, b) * b
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

-- ARGV[1] is the caller's clock when one was injected, '' otherwise: then
-- Redis's own clock decides, so that no two workers disagree about time.
local function clock()
  if ARGV[1] ~= '' then return tonumber(ARGV[1]) end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end
