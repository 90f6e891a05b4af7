-- Head of every rate-limit script: its arguments (see lua.go).

-- keep_for gives a key the TTL its state needs (reset µs, > 0) plus the
-- caller's slack (ARGV[7]): an injected clock need not run with Redis's.
local function keep_for(key, reset)
  redis.call('PEXPIRE', key, ceildiv(reset + tonumber(ARGV[7]), 1000))
end

local now = clock()
local limit = tonumber(ARGV[2])
local period = tonumber(ARGV[3])
local burst = tonumber(ARGV[4])
local windows = tonumber(ARGV[5])
local n = tonumber(ARGV[6])
