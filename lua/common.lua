-- Common to every sluice script (lua.go puts it in front of each one).
--
-- All times are integer microseconds. A Unix time in µs is below 2^53, so
-- Lua's doubles hold it, and every product the scripts form exactly; numbers
-- are written back with int(), because Redis would otherwise format them with
-- %.14g and drop digits.

-- Redis 5 and 6 replicate scripts verbatim unless told otherwise, and a
-- verbatim script may not write after reading TIME. Redis 7 always
-- replicates effects and keeps this call as a no-op.
if redis.replicate_commands then redis.replicate_commands() end

local function int(x)
  return string.format('%.0f', x)
end

-- floordiv and ceildiv divide non-negative integers exactly: a / b is
-- rounded, so the quotient is checked against the product and mended.
local function floordiv(a, b)
  local q = math.floor(a / b)
  if q * b > a then
    q = q - 1
  elseif (q + 1) * b <= a then
    q = q + 1
  end
  return q
end

local function ceildiv(a, b)
  local q = floordiv(a, b)
  if q * b < a then q = q + 1 end
  return q
end

-- ARGV[1] is the caller's clock when one was injected, '' otherwise: then
-- Redis's own clock decides, so that no two workers disagree about time.
local function clock()
  if ARGV[1] ~= '' then return tonumber(ARGV[1]) end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end

