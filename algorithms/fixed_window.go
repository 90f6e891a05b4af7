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
	Set    bool  // false: nothing counted yet
	Window int64 // time / Period
	Count  int64
}

// Trim implements State: a window is forgotten by being replaced.
func (s *FixedWindowState) Trim(Params, int64) {}

// Decide implements State; it mirrors decide in lua/fixed_window.lua.
func (s *FixedWindowState) Decide(p Params, at, n int64) Result {
	window := floorDiv(at, p.Period)
	if s.Set && s.Window > window {
		// A later window is counted already (a reservation, or a clock that
		// stepped back): nothing fits before it starts, and then what it has left.
		laterEnd := (s.Window+1)*p.Period - at
		if s.Count+n <= p.Limit {
			return Result{RetryAfter: s.Window*p.Period - at, ResetAfter: laterEnd}
		}
		return Result{RetryAfter: laterEnd, ResetAfter: laterEnd}
	}
	used := int64(0)
	if s.Set && s.Window == window {
		used = s.Count
	}
	windowEnd := (window+1)*p.Period - at
	if used+n > p.Limit {
		return Result{Remaining: max(0, p.Limit-used), RetryAfter: windowEnd, ResetAfter: windowEnd}
	}
	return Result{Allowed: true, Remaining: p.Limit - used - n, ResetAfter: windowEnd}
}

// Record implements State.
func (s *FixedWindowState) Record(p Params, at, n int64) {
	if window := floorDiv(at, p.Period); s.Set && s.Window == window {
		s.Count += n
	} else {
		s.Set, s.Window, s.Count = true, window, n
	}
}

// GiveBack implements State.
func (s *FixedWindowState) GiveBack(p Params, at, n int64) {
	if s.Set && s.Window == floorDiv(at, p.Period) {
		s.Count = max(0, s.Count-n)
	}
}
