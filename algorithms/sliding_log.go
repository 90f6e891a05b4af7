package algorithms

import (
	"slices"
	"sort"

	"github.com/sluicehq/sluice/lua"
)

// SlidingLog admits at most Limit events in any interval (t-Period, t]. It is
// exact and costs one entry per counted event.
var SlidingLog = &Algorithm{
	Name:     "sliding_log",
	NewState: func() State { return &SlidingLogState{} },
	Script:   newScript(lua.SlidingLog),
	Capacity: limitCapacity,
}

// SlidingLogState holds the times of the counted events, oldest first.
type SlidingLogState struct {
	Times []int64
}

// after returns the index of the first event later than t.
func (s *SlidingLogState) after(t int64) int {
	return sort.Search(len(s.Times), func(i int) bool { return s.Times[i] > t })
}

// Trim implements State: events at or before now-Period are forgotten.
func (s *SlidingLogState) Trim(p Params, now int64) {
	s.Times = s.Times[s.after(now-p.Period):]
}

// Decide implements State; it mirrors decide in lua/sliding_log.lua.
func (s *SlidingLogState) Decide(p Params, at, n int64) Result {
	first := s.after(at - p.Period)
	count := int64(len(s.Times) - first)
	newest := at // the newest event's time (there is none only when n fit)
	if count > 0 {
		newest = s.Times[len(s.Times)-1]
	}
	if count+n > p.Limit {
		// n fit once the (count + n - Limit)th oldest event has aged out.
		kth := s.Times[first+int(count+n-p.Limit)-1]
		return Result{Remaining: max(0, p.Limit-count), RetryAfter: kth + p.Period - at, ResetAfter: newest + p.Period - at}
	}
	return Result{Allowed: true, Remaining: p.Limit - count - n, ResetAfter: max(newest, at) + p.Period - at}
}

// Record implements State, keeping Times sorted as a sorted set would.
func (s *SlidingLogState) Record(_ Params, at, n int64) {
	i := s.after(at)
	s.Times = slices.Insert(s.Times, i, slices.Repeat([]int64{at}, int(n))...)
}

// GiveBack implements State.
func (s *SlidingLogState) GiveBack(_ Params, at, n int64) {
	end := s.after(at)
	start := end
	for start > 0 && s.Times[start-1] == at && int64(end-start) < n {
		start--
	}
	s.Times = slices.Delete(s.Times, start, end)
}
