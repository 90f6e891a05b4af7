-- settle_instant moves at on, pass by pass, to the instant at which
-- every claim's earliest turn is at itself: each claim's earliest turn
-- only moves forward as the instant asked about does. It stops after
-- MAX_PASSES passes, or once at is more than max_wait after now. One
-- claim's own earliest turn is settled already. It returns the instant
-- and whether it settled there.
local MAX_PASSES = 16 -- see maxPasses in algorithms.go
local function settle_instant(claims, at, now, max_wait)
  local settled = #claims == 1 and at - now <= max_wait
  local pass = 0
  while not settled and pass < MAX_PASSES and at - now <= max_wait do
    local next_ = at
    for _, c in ipairs(claims) do
      next_ = c.g.earliest(next_)
      if next_ - now > max_wait then break end
    end
    if next_ == at then
      settled = true
      break
    end
    at, pass = next_, pass + 1
  end
  return at, settled
end
