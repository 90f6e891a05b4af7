package algorithms

import (
	"slices"
	"strconv"
)

// FixedWindow admits at most Limit events in each window
// [k*Period, (k+1)*Period) since the Unix epoch: a CounterState with one
// sub-window per Period (package throttle sets Windows to 1).
var FixedWindow = &Algorithm{
	Name:     "fixed_window",
	NewState: func() State { return &CounterState{} },
	Capacity: limitCapacity,
}

// SlidingCounter admits an event while the events of the last Windows
// sub-windows of Period/Windows each (the current one included) add up to at
// most Limit: nearly as smooth as SlidingLog at the cost of Windows counters.
var SlidingCounter = &Algorithm{
	Name:     "sliding_counter",
	NewState: func() State { return &CounterState{} },
	Capacity: limitCapacity,
}

// maxWindows bounds Windows: every decision sums up to twice as many
// counters.
const maxWindows = 1000

// CounterState counts events per sub-window of Period/Windows; it mirrors
// new_counter in lua/counter.lua. Events counted at an instant fall in every
// run of Windows consecutive sub-windows that holds that instant's, and each
// run holds at most Limit: so turns may be booked in any order, and given
// back exactly.
type CounterState struct {
	Counts []SubWindow // sub-windows with events, by index
}

// SubWindow is the count of events counted in sub-window Index
// (= time / (Period/Windows)).
type SubWindow struct {
	Index, Count int64
}

func (s *CounterState) find(index int64) (int, bool) {
	return slices.BinarySearchFunc(s.Counts, index, func(w SubWindow, x int64) int { return cmpInt(w.Index, x) })
}

func (s *CounterState) count(index int64) int64 {
	if i, ok := s.find(index); ok {
		return s.Counts[i].Count
	}
	return 0
}

// Trim implements State: sub-windows that slid out by now are forgotten.
func (s *CounterState) Trim(p Params, now int64) {
	current := floorDiv(now, p.Period/p.Windows)
	s.Counts = slices.DeleteFunc(s.Counts, func(w SubWindow) bool { return w.Index <= current-p.Windows })
}

// runs returns the largest total of a run of Windows sub-windows that holds
// sub-window i, and the index of the last run (by its last sub-window) whose
// total is above most, or i-1 if none is.
func (s *CounterState) runs(p Params, i, most int64) (largest, lastOver int64) {
	total := int64(0)
	for k := i - p.Windows + 1; k <= i; k++ {
		total += s.count(k)
	}
	largest, lastOver = total, i-1
	for j := i; ; j++ {
		if total > most {
			lastOver = j
		}
		largest = max(largest, total)
		if j == i+p.Windows-1 {
			return largest, lastOver
		}
		total += s.count(j+1) - s.count(j+1-p.Windows)
	}
}

// Earliest implements State: the first sub-window from at's on, all of
// whose runs have room for n.
func (s *CounterState) Earliest(p Params, at, n int64) int64 {
	sub := p.Period / p.Windows
	for i := floorDiv(at, sub); ; {
		_, over := s.runs(p, i, p.Limit-n)
		if over < i {
			return max(at, i*sub)
		}
		i = over + 1 // every run up to over must be left behind
	}
}

// Record implements State, keeping Counts sorted.
func (s *CounterState) Record(p Params, at, n int64) string {
	index := floorDiv(at, p.Period/p.Windows)
	if i, ok := s.find(index); ok {
		s.Counts[i].Count += n
	} else {
		s.Counts = slices.Insert(s.Counts, i, SubWindow{index, n})
	}
	return strconv.FormatInt(at, 10)
}

// GiveBack implements State: pieces is the instant the events were
// counted at.
func (s *CounterState) GiveBack(p Params, pieces string, n int64) {
	at, err := strconv.ParseInt(pieces, 10, 64)
	if err != nil {
		return
	}
	i, ok := s.find(floorDiv(at, p.Period/p.Windows))
	if !ok {
		return
	}
	if s.Counts[i].Count -= n; s.Counts[i].Count <= 0 {
		s.Counts = slices.Delete(s.Counts, i, i+1)
	}
}

// Room implements State.
func (s *CounterState) Room(p Params, at int64) int64 {
	largest, _ := s.runs(p, floorDiv(at, p.Period/p.Windows), p.Limit)
	return max(0, p.Limit-largest)
}

// ResetAfter implements State: until the newest sub-window has slid out.
func (s *CounterState) ResetAfter(p Params, at int64) int64 {
	if len(s.Counts) == 0 {
		return 0
	}
	return max(0, (s.Counts[len(s.Counts)-1].Index+p.Windows)*(p.Period/p.Windows)-at)
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

// Empty implements State.
func (s *CounterState) Empty() bool { return len(s.Counts) == 0 }

// Used implements State: the sub-windows up to now's, each at its last µs
// (or now, for now's own).
func (s *CounterState) Used(p Params, now int64) Used {
	sub := p.Period / p.Windows
	var u Used
	for _, w := range s.Counts {
		if w.Index > floorDiv(now, sub) {
			break
		}
		u.Events = append(u.Events, Event{At: min(now, (w.Index+1)*sub-1), N: w.Count})
	}
	return u
}

// Seed implements State.
func (s *CounterState) Seed(p Params, _ int64, u Used) {
	for _, e := range u.Events {
		s.Record(p, e.At, e.N)
	}
}
