-- Head of every rate-limit script: its arguments (see lua.go), and the
-- packing of states kept as one string.

local now = clock()
local limit = tonumber(ARGV[2])
local period = tonumber(ARGV[3])
local burst = tonumber(ARGV[4])
local windows = tonumber(ARGV[5])
local n = tonumber(ARGV[6])
-- slack (µs) is added to every TTL: an injected clock need not run with
-- Redis's.
local slack = tonumber(ARGV[7])

-- A state of three integers is one string "a b c", read with one GET and
-- written with one SET ... PX: the fewest commands a call can make.
local function unpack_state(s)
  local a, b, c = string.match(s, '^(%-?%d+) (%-?%d+) (%-?%d+)$')
  return tonumber(a), tonumber(b), tonumber(c)
end

local function pack_state(a, b, c)
  return string.format('%d %d %d', a, b, c)
end
