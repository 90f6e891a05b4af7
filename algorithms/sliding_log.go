package algorithms

import (
	"sort"

	"github.com/sluicehq/sluice/lua"
)

// SlidingLog admits at most Limit events in any interval (t-Period, t]. It is
// exact and costs one entry per admitted event.
var SlidingLog = &Algorithm{
	Name:     "sliding_log",
	NewState: func() State { return &SlidingLogState{} },
	Script:   newScript(lua.SlidingLog),
	Capacity: limitCapacity,
}

// SlidingLogState holds the times of the admitted events, oldest first.
type SlidingLogState struct {
	Times []int64
}

// Step implements State; it mirrors lua/sliding_log.lua.
func (s *SlidingLogState) Step(p Params, now, n int64) Result {
	// Drop what aged out: times <= now - Period.
	expired := sort.Search(len(s.Times), func(i int) bool { return s.Times[i] > now-p.Period })
	s.Times = s.Times[expired:]
	count := int64(len(s.Times))
	newest := now // the newest event's time (count is 0 only on the way to admitting)
	if count > 0 {
		newest = s.Times[count-1]
	}
	if count+n > p.Limit {
		kth := s.Times[count+n-p.Limit-1]
		return Result{Remaining: max(0, p.Limit-count), RetryAfter: kth + p.Period - now, ResetAfter: newest + p.Period - now}
	}
	// Keep Times sorted even when the clock stepped back, as a sorted set would.
	at := sort.Search(len(s.Times), func(i int) bool { return s.Times[i] > now })
	s.Times = append(s.Times, make([]int64, n)...)
	copy(s.Times[at+int(n):], s.Times[at:])
	for i := at; i < at+int(n); i++ {
		s.Times[i] = now
	}
	newest = max(newest, now)
	return Result{Allowed: true, Remaining: p.Limit - count - n, ResetAfter: newest + p.Period - now}
}
