package algorithms

import (
	"math"
	"slices"
	"sort"
)

// TokenBucket holds Burst tokens, starts full and refills continuously at
// Limit per Period; a call takes n tokens, or none when fewer are left.
var TokenBucket = &Algorithm{
	Name:     "token_bucket",
	NewState: func() State { return &BucketState{} },
	Capacity: burstCapacity,
}

// LeakyBucket is a bucket of size Burst that starts empty and leaks
// continuously at Limit per Period; a call pours in n if they fit. With
// Burst 1 it spaces events exactly Period/Limit apart.
var LeakyBucket = &Algorithm{
	Name:     "leaky_bucket",
	NewState: func() State { return &BucketState{} },
	Capacity: burstCapacity,
}

// BucketState is both buckets. A full token bucket and an empty leaky bucket
// admit the same events: at most Burst + Limit·T/Period in any interval of
// length T. That is so exactly when a server that works off each event in
// Period/Limit can finish every event within Burst·Period/Limit of its
// instant. The state is the server time taken: booking n events at x takes
// the first n·Period/Limit of free time from x on, and they fit when that
// much is free before x + Burst·Period/Limit.
//
// Booked in time order, this is the classic bucket (the busy time ends
// where the bucket's level would reach zero). Booked in any other order it
// still never admits more than the bucket would, fills gaps left between
// turns booked earlier, and gives back exactly the time a cancelled booking
// took. It mirrors new_bucket in lua/bucket.lua.
//
// Time is counted in units of 1/(Limit/g) µs, g = gcd(Limit, Period), so
// that one event takes a whole number of units (Period/g), from Ref.
type BucketState struct {
	Ref  int64  // µs: where units count from
	Busy []Span // sorted, disjoint, never touching
}

// Span is busy server time [Start, End), in units since Ref.
type Span struct{ Start, End int64 }

// bucketUnits are the units of a bucket's Params: perMicro units make a µs,
// perEvent units one event's server time, window the room an event may
// finish within.
type bucketUnits struct{ perMicro, perEvent, window int64 }

func unitsOf(p Params) bucketUnits {
	g := gcd(p.Limit, p.Period)
	return bucketUnits{perMicro: p.Limit / g, perEvent: p.Period / g, window: p.Burst * (p.Period / g)}
}

// rebaseAfter is how far (in units) Ref may fall behind now before the
// spans are counted from a newer one, keeping every position exact.
const rebaseAfter = 1 << 50

// at returns the position of instant t.
func (s *BucketState) at(u bucketUnits, t int64) int64 { return (t - s.Ref) * u.perMicro }

// Trim implements State: busy time that ended by now is forgotten.
func (s *BucketState) Trim(p Params, now int64) {
	u := unitsOf(p)
	x := s.at(u, now)
	i := sort.Search(len(s.Busy), func(i int) bool { return s.Busy[i].End > x })
	s.Busy = s.Busy[i:]
	switch {
	case len(s.Busy) == 0:
		s.Ref = now
	case x > rebaseAfter:
		for i := range s.Busy {
			s.Busy[i].Start -= x
			s.Busy[i].End -= x
		}
		s.Ref = now
	}
}

// first returns the index of the first span that ends after x.
func (s *BucketState) first(x int64) int {
	return sort.Search(len(s.Busy), func(i int) bool { return s.Busy[i].End > x })
}

// busyIn is the busy time in [from, to).
func (s *BucketState) busyIn(from, to int64) int64 {
	busy := int64(0)
	for i := s.first(from); i < len(s.Busy) && s.Busy[i].Start < to; i++ {
		busy += min(s.Busy[i].End, to) - max(s.Busy[i].Start, from)
	}
	return busy
}

// Earliest implements State. free(x), the free time in [x, x+window), is
// continuous and piecewise linear in x, with slope +1 while x is busy and
// x+window free, -1 the other way round, 0 otherwise. The walk goes from
// one change of slope to the next and returns the first whole µs at which
// free(x) is enough.
func (s *BucketState) Earliest(p Params, at, n int64) int64 {
	u := unitsOf(p)
	need := n * u.perEvent
	a := s.at(u, at)
	free := u.window - s.busyIn(a, a+u.window)
	left, right := s.first(a), s.first(a+u.window) // spans ahead of each edge
	for {
		leftBusy := left < len(s.Busy) && s.Busy[left].Start <= a
		rightBusy := right < len(s.Busy) && s.Busy[right].Start <= a+u.window
		b, slope := int64(math.MaxInt64), int64(0)
		if left < len(s.Busy) {
			b = s.Busy[left].Start
			if leftBusy {
				b, slope = s.Busy[left].End, slope+1
			}
		}
		if right < len(s.Busy) {
			next := s.Busy[right].Start - u.window
			if rightBusy {
				next, slope = s.Busy[right].End-u.window, slope-1
			}
			b = min(b, next)
		}
		if x, ok := firstFit(a, b, free, slope, need, u.perMicro); ok {
			return s.Ref + x/u.perMicro
		}
		free += slope * (b - a)
		a = b
		if leftBusy && a == s.Busy[left].End {
			left++
		}
		if rightBusy && a+u.window == s.Busy[right].End {
			right++
		}
	}
}

// firstFit is the first multiple of grid in [a, b] at which free(x) =
// free + slope·(x-a) is at least need.
func firstFit(a, b, free, slope, need, grid int64) (int64, bool) {
	x := ceilDiv(a, grid) * grid
	switch {
	case x > b:
		return 0, false
	case slope > 0 && free < need:
		x = max(x, ceilDiv(a+need-free, grid)*grid)
	case free+slope*(x-a) < need:
		return 0, false
	}
	return x, x <= b
}

// Record implements State: the events take the first free time from at
// on. Every gap they fill joins the spans on either side, so the spans from
// at's to the last one reached become one.
func (s *BucketState) Record(p Params, at, n int64) string {
	u := unitsOf(p)
	x := s.at(u, at)
	need := n * u.perEvent
	var pieces []int64
	start, i := x, s.first(x)
	if i < len(s.Busy) && s.Busy[i].Start <= x {
		start = s.Busy[i].Start
	} else if i > 0 && s.Busy[i-1].End == x {
		i--
		start = s.Busy[i].Start
	}
	j, cur := i, x
	for need > 0 {
		if j < len(s.Busy) && s.Busy[j].Start <= cur {
			cur = max(cur, s.Busy[j].End)
			j++
			continue
		}
		take := need
		if j < len(s.Busy) {
			take = min(need, s.Busy[j].Start-cur)
		}
		pieces = append(pieces, cur, cur+take)
		need -= take
		cur += take
	}
	if j < len(s.Busy) && s.Busy[j].Start == cur { // the last piece touches the next span
		cur = s.Busy[j].End
		j++
	}
	s.Busy = slices.Replace(s.Busy, i, j, Span{start, cur})
	return joinInts(append([]int64{s.Ref}, pieces...)...)
}

// GiveBack implements State: pieces is "ref s1 e1 s2 e2 ...", the server
// time Record took, in units since ref.
func (s *BucketState) GiveBack(p Params, pieces string, _ int64) {
	v := ints(pieces)
	if len(v) < 3 || len(v)%2 == 0 {
		return
	}
	u := unitsOf(p)
	shift := v[0] - s.Ref
	if shift < -rebaseAfter/u.perMicro {
		return // long gone: trimmed away before a rebase
	}
	shift *= u.perMicro
	for k := 1; k < len(v); k += 2 {
		s.free(v[k]+shift, v[k+1]+shift)
	}
}

// free makes [from, to) free.
func (s *BucketState) free(from, to int64) {
	var kept []Span
	for _, sp := range s.Busy {
		if sp.End <= from || sp.Start >= to {
			kept = append(kept, sp)
			continue
		}
		if sp.Start < from {
			kept = append(kept, Span{sp.Start, from})
		}
		if sp.End > to {
			kept = append(kept, Span{to, sp.End})
		}
	}
	s.Busy = kept
}

// Room implements State: how many events' time is free in the window from
// at.
func (s *BucketState) Room(p Params, at int64) int64 {
	u := unitsOf(p)
	x := s.at(u, at)
	return floorDiv(u.window-s.busyIn(x, x+u.window), u.perEvent)
}

// ResetAfter implements State: until the last busy time ends.
func (s *BucketState) ResetAfter(p Params, at int64) int64 {
	if len(s.Busy) == 0 {
		return 0
	}
	u := unitsOf(p)
	return max(0, ceilDiv(s.Busy[len(s.Busy)-1].End-s.at(u, at), u.perMicro))
}

// LeaseWindow is, for events booked at once on a bucket (pieces, as Record
// returned them), the instants at which each of them may happen instead of
// the instant they were booked at: from the end of their server time less
// the window, to its start. An event at any such instant still has its
// server time within the window after it, so the bucket's limit holds
// (see BucketState). ok is false when no instant is left.
func LeaseWindow(p Params, pieces string) (from, to int64, ok bool) {
	v := ints(pieces)
	if len(v) < 3 || len(v)%2 == 0 {
		return 0, 0, false
	}
	u := unitsOf(p)
	ref, first, last := v[0], v[1], v[len(v)-1]
	from = ref + ceilDiv(last-u.window, u.perMicro)
	to = ref + floorDiv(first, u.perMicro)
	return from, to, from <= to
}

// TailPieces returns the pieces of the last n of the events that pieces
// took: what giving back n of them, unused, gives back. The events used
// keep the earliest server time, which lies within the window after any
// instant of LeaseWindow.
func TailPieces(p Params, pieces string, n int64) string {
	v := ints(pieces)
	if len(v) < 3 || len(v)%2 == 0 || n <= 0 {
		return ""
	}
	need := n * unitsOf(p).perEvent
	var tail []int64
	for k := len(v) - 2; k >= 1 && need > 0; k -= 2 {
		start, end := v[k], v[k+1]
		take := min(need, end-start)
		tail = append([]int64{end - take, end}, tail...)
		need -= take
	}
	return joinInts(append([]int64{v[0]}, tail...)...)
}

// Empty implements State.
func (s *BucketState) Empty() bool { return len(s.Busy) == 0 }

// Used implements State: the server time taken within the bucket's window
// from now, in µs rounded up. (What of it turns booked ahead took cannot
// be told apart: it is taken over too, at most the old bucket's window.)
func (s *BucketState) Used(p Params, now int64) Used {
	u := unitsOf(p)
	x := s.at(u, now)
	return Used{Busy: ceilDiv(s.busyIn(x, x+u.window), u.perMicro)}
}

// Seed implements State: the server time from now on, up to the furthest
// position counted exactly.
func (s *BucketState) Seed(p Params, now int64, used Used) {
	u := unitsOf(p)
	s.Ref = now
	if used.Busy > 0 {
		s.Busy = []Span{{0, min(used.Busy, rebaseAfter/u.perMicro) * u.perMicro}}
	}
}
