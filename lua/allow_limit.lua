-- allow_limit: the decision of one limit's AllowN or ReserveN on g, a
-- limit its algorithm's constructor built: book.lua's book of one claim
-- with no ID, nothing to give back, no replaced limit, no recent throttles
-- and no remind. start is the earliest instant (not before, or now),
-- max_wait the longest wait (µs; 0 counts now or never), slack what is
-- added to every TTL (µs). It returns book.lua's output for one claim:
-- {ok (1: booked, 0: not), now, at, remaining, retry_after, reset_after,
-- pieces}.
local function allow_limit(g, now, start, max_wait, slack)
  g.trim(now)

  -- As book.lua's save.
  local function save()
    local life = math.max(g.reset_after(now), g.blocked - now, 0)
    g.save(math.max(1, ceildiv(life + slack, 1000)))
  end

  local from = math.max(start, g.blocked)
  local at = from
  if from - now <= max_wait then at = g.earliest(from) end
  if at - now > max_wait then
    local room = 0
    if from == now then room = g.room(now) end
    local reply = {0, now, at, room, at - now, math.max(from - now, g.reset_after(now)), ''}
    save() -- what trimming changed
    return reply
  end
  local pieces = g.record(at)
  local reply = {1, now, at, g.room(at), 0, at - now + g.reset_after(at), pieces}
  save()
  return reply
end

-- lean_options reads the lean scripts' last arguments from ARGV[i] on:
-- TTL slack (µs), the longest wait (µs) and not before (µs), each left
-- out, with those after it, where all are 0. It returns slack, max_wait
-- and start (the later of not before and now).
local function lean_options(i, now)
  local slack, max_wait, start = 0, 0, now
  if ARGV[i] then
    slack = ARGV[i] + 0
    if ARGV[i + 1] then
      max_wait = ARGV[i + 1] + 0
      if ARGV[i + 2] and ARGV[i + 2] + 0 > now then start = ARGV[i + 2] + 0 end
    end
  end
  return slack, max_wait, start
end
