package algorithms

import "github.com/sluicehq/sluice/lua"

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

// SubWindow is the count of events admitted in sub-window Index
// (= time / (Period/Windows)).
type SubWindow struct {
	Index, Count int64
}

// Step implements State; it mirrors lua/sliding_counter.lua.
func (s *SlidingCounterState) Step(p Params, now, n int64) Result {
	sub := p.Period / p.Windows
	current := floorDiv(now, sub)
	live := s.Windows[:0]
	total := int64(0)
	for _, w := range s.Windows {
		if w.Index > current-p.Windows {
			live = append(live, w)
			total += w.Count
		}
	}
	s.Windows = live // sorted, so the last is the newest
	if total+n > p.Limit {
		// Sub-window i slides out at (i + Windows) * sub.
		need, freed, retry := total+n-p.Limit, int64(0), int64(0)
		for _, w := range s.Windows {
			freed += w.Count
			if freed >= need {
				retry = (w.Index+p.Windows)*sub - now
				break
			}
		}
		newest := s.Windows[len(s.Windows)-1].Index
		return Result{Remaining: max(0, p.Limit-total), RetryAfter: retry, ResetAfter: (newest+p.Windows)*sub - now}
	}
	s.add(current, n)
	newest := s.Windows[len(s.Windows)-1].Index
	return Result{Allowed: true, Remaining: p.Limit - total - n, ResetAfter: (newest+p.Windows)*sub - now}
}

// add counts n events in sub-window index, keeping Windows sorted.
func (s *SlidingCounterState) add(index, n int64) {
	for i := range s.Windows {
		switch {
		case s.Windows[i].Index == index:
			s.Windows[i].Count += n
			return
		case s.Windows[i].Index > index:
			s.Windows = append(s.Windows[:i], append([]SubWindow{{index, n}}, s.Windows[i:]...)...)
			return
		}
	}
	s.Windows = append(s.Windows, SubWindow{index, n})
}
