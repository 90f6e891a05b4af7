package algorithms

import (
	"slices"

	"github.com/sluicehq/sluice/lua"
)

// SlidingCounter admits an event while the events of the last Windows
// sub-windows of Period/Windows each (the current one included) add up to at
// most Limit: nearly as smooth as SlidingLog at the cost of Windows counters.
var SlidingCounter = &Algorithm{
	Name:     "sliding_counter",
	NewState: func() State { return &SlidingCounterState{} },
	Script:   newScript(lua.SlidingCounter),
	Capacity: limitCapacity,
}

// SlidingCounterState holds the live sub-windows, oldest first.
type SlidingCounterState struct {
	Windows []SubWindow
}

// SubWindow is the count of events counted in sub-window Index
// (= time / (Period/Windows)).
type SubWindow struct {
	Index, Count int64
}

// Trim implements State: sub-windows that slid out by now are forgotten.
func (s *SlidingCounterState) Trim(p Params, now int64) {
	current := floorDiv(now, p.Period/p.Windows)
	s.Windows = slices.DeleteFunc(s.Windows, func(w SubWindow) bool { return w.Index <= current-p.Windows })
}

// Decide implements State; it mirrors decide in lua/sliding_counter.lua.
func (s *SlidingCounterState) Decide(p Params, at, n int64) Result {
	sub := p.Period / p.Windows
	current := floorDiv(at, sub)
	total, latest, counted := int64(0), int64(0), false
	for _, w := range s.Windows {
		if w.Index > current-p.Windows {
			total, latest, counted = total+w.Count, w.Index, true
		}
	}
	if total+n <= p.Limit {
		newest := current
		if counted {
			newest = max(latest, current)
		}
		return Result{Allowed: true, Remaining: p.Limit - total - n, ResetAfter: (newest+p.Windows)*sub - at}
	}
	// n fit once enough of the oldest sub-windows have slid out; sub-window
	// i slides out at (i + Windows) * sub.
	need, freed := total+n-p.Limit, int64(0)
	for _, w := range s.Windows {
		if w.Index > current-p.Windows {
			if freed += w.Count; freed >= need {
				return Result{Remaining: max(0, p.Limit-total), RetryAfter: (w.Index+p.Windows)*sub - at, ResetAfter: (latest+p.Windows)*sub - at}
			}
		}
	}
	panic("algorithms: sliding counter cannot free n <= Limit events")
}

// Record implements State, keeping Windows sorted.
func (s *SlidingCounterState) Record(p Params, at, n int64) {
	index := floorDiv(at, p.Period/p.Windows)
	i, found := slices.BinarySearchFunc(s.Windows, index, func(w SubWindow, x int64) int { return cmpInt(w.Index, x) })
	if found {
		s.Windows[i].Count += n
		return
	}
	s.Windows = slices.Insert(s.Windows, i, SubWindow{index, n})
}

// GiveBack implements State.
func (s *SlidingCounterState) GiveBack(p Params, at, n int64) {
	index := floorDiv(at, p.Period/p.Windows)
	i, found := slices.BinarySearchFunc(s.Windows, index, func(w SubWindow, x int64) int { return cmpInt(w.Index, x) })
	if !found {
		return
	}
	if s.Windows[i].Count -= n; s.Windows[i].Count <= 0 {
		s.Windows = slices.Delete(s.Windows, i, i+1)
	}
}

func cmpInt(a, b int64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}
