package algorithms

import "github.com/sluicehq/sluice/lua"

// FixedWindow admits at most Limit events in each window
// [k*Period, (k+1)*Period) since the Unix epoch.
var FixedWindow = &Algorithm{
	Name:     "fixed_window",
	NewState: func() State { return &FixedWindowState{} },
	Script:   newScript(lua.FixedWindow),
	Capacity: limitCapacity,
}

// FixedWindowState is the window last counted and its count.
type FixedWindowState struct {
	Window int64 // now / Period
	Count  int64
}

// Step implements State; it mirrors lua/fixed_window.lua.
func (s *FixedWindowState) Step(p Params, now, n int64) Result {
	window, count := floorDiv(now, p.Period), int64(0)
	// A window ahead of ours means the clock stepped back: keep counting it.
	if s.Count > 0 && s.Window >= window {
		window, count = s.Window, s.Count
	}
	windowEnd := (window+1)*p.Period - now
	if count+n > p.Limit {
		return Result{Remaining: max(0, p.Limit-count), RetryAfter: windowEnd, ResetAfter: windowEnd}
	}
	s.Window, s.Count = window, count+n
	return Result{Allowed: true, Remaining: p.Limit - s.Count, ResetAfter: windowEnd}
}
