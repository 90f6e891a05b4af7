package algorithms

import (
	"slices"
	"sort"
	"strconv"
)

// SlidingLog admits at most Limit events in any interval (t-Period, t]. It is
// exact and costs one entry per counted event.
var SlidingLog = &Algorithm{
	Name:     "sliding_log",
	NewState: func() State { return &SlidingLogState{} },
	Capacity: limitCapacity,
}

// maxLogLimit bounds a sliding log's Limit: a decision may look at every
// event of two Periods.
const maxLogLimit = 10_000

// SlidingLogState holds the times of the counted events, oldest first; it
// mirrors new_sliding_log in lua/sliding_log.lua. An event at x falls in
// every window (y-Period, y] with y in [x, x+Period): n events fit at x if
// none of those windows is full, so turns may be booked in any order.
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

// window sweeps the ends y of windows (y-Period, y], keeping the events in
// the window between lo and hi.
type window struct {
	times  []int64
	period int64
	y      int64
	lo, hi int
}

func (s *SlidingLogState) windowAt(p Params, y int64) *window {
	return &window{times: s.Times, period: p.Period, y: y, lo: s.after(y - p.Period), hi: s.after(y)}
}

func (w *window) count() int64 { return int64(w.hi - w.lo) }

// nextEntry is when the next event enters the window, if any does.
func (w *window) nextEntry() (int64, bool) {
	if w.hi == len(w.times) {
		return 0, false
	}
	return w.times[w.hi], true
}

// moveTo moves the window's end to y, later than before.
func (w *window) moveTo(y int64) {
	w.y = y
	for w.hi < len(w.times) && w.times[w.hi] <= y {
		w.hi++
	}
	for w.lo < w.hi && w.times[w.lo] <= y-w.period {
		w.lo++
	}
}

// nextChange is the next instant an event enters or leaves the window.
func (w *window) nextChange() int64 {
	next := w.times[w.lo] + w.period // the window is not empty when asked
	if entry, ok := w.nextEntry(); ok {
		next = min(next, entry)
	}
	return next
}

// Earliest implements State: the first x from at on such that no window
// ending in [x, x+Period) holds more than Limit-n events.
func (s *SlidingLogState) Earliest(p Params, at, n int64) int64 {
	most := p.Limit - n
	x := at
	w := s.windowAt(p, x)
	for {
		if w.count() > most {
			// Every window ending from here until enough events have left
			// is too full: the turn comes after them.
			for w.count() > most {
				w.moveTo(w.nextChange())
			}
			x = w.y
			continue
		}
		entry, ok := w.nextEntry()
		if !ok || entry >= x+p.Period {
			return x
		}
		w.moveTo(entry)
	}
}

// Record implements State, keeping Times sorted as a sorted set would.
func (s *SlidingLogState) Record(_ Params, at, n int64) string {
	i := s.after(at)
	s.Times = slices.Insert(s.Times, i, slices.Repeat([]int64{at}, int(n))...)
	return strconv.FormatInt(at, 10)
}

// GiveBack implements State: pieces is the instant the events were counted
// at.
func (s *SlidingLogState) GiveBack(_ Params, pieces string, n int64) {
	at, err := strconv.ParseInt(pieces, 10, 64)
	if err != nil {
		return
	}
	end := s.after(at)
	start := end
	for start > 0 && s.Times[start-1] == at && int64(end-start) < n {
		start--
	}
	s.Times = slices.Delete(s.Times, start, end)
}

// Room implements State: Limit less the fullest window at falls in.
func (s *SlidingLogState) Room(p Params, at int64) int64 {
	w := s.windowAt(p, at)
	fullest := w.count()
	for {
		entry, ok := w.nextEntry()
		if !ok || entry >= at+p.Period {
			return max(0, p.Limit-fullest)
		}
		w.moveTo(entry)
		fullest = max(fullest, w.count())
	}
}

// ResetAfter implements State: until the newest event has aged out.
func (s *SlidingLogState) ResetAfter(p Params, at int64) int64 {
	if len(s.Times) == 0 {
		return 0
	}
	return max(0, s.Times[len(s.Times)-1]+p.Period-at)
}

// Empty implements State.
func (s *SlidingLogState) Empty() bool { return len(s.Times) == 0 }

// Used implements State: the events up to now.
func (s *SlidingLogState) Used(_ Params, now int64) Used {
	var u Used
	for _, t := range s.Times[:s.after(now)] {
		u.Events = append(u.Events, Event{At: t, N: 1})
	}
	return u
}

// Seed implements State.
func (s *SlidingLogState) Seed(p Params, _ int64, u Used) {
	for _, e := range u.Events {
		s.Record(p, e.At, e.N)
	}
}
