// Package algorithms holds sluice's five rate-limit algorithms, each twice:
// as a state in Go (the in-process engine, and the reference model the Lua
// is tested against) and as the constructor in lua/ that keeps the same
// state on Redis; and the one operation every caller uses, Book: count n
// events on several keys at the earliest instant at which all of them fit.
//
// Everything here counts time in integer microseconds and events in whole
// numbers, so that the Go and Lua twins agree to the last microsecond.
// Callers validate Params and n (see package throttle); this package assumes
// 1 <= n <= capacity and the bounds that Algorithm.Check enforces.
//
// # Turns in any order
//
// A state answers for any instant, not only the latest: a turn may be booked
// before turns booked earlier (a queue drained at 5/s books its turns far
// ahead; a faster one that shares its quota must still get the gaps between
// them), and any turn can be given back exactly. The windowed algorithms
// keep their events by time and check every window an event would fall in;
// the buckets keep the server time their events take (see BucketState).
package algorithms

import (
	"fmt"
	"strconv"
	"strings"
)

// MaxExact is the largest integer every intermediate value must stay below:
// Lua numbers are doubles and hold integers exactly up to 2^53.
const MaxExact = 1 << 53

// Params is the shape of one limit, in the units the states use.
type Params struct {
	Limit   int64 // events per Period
	Period  int64 // µs
	Burst   int64 // token_bucket and leaky_bucket: capacity in events
	Windows int64 // sliding_counter: sub-windows per Period
}

// State is one key's state under one algorithm: the Go twin of an
// algorithm's constructor in lua/. Instants are µs.
type State interface {
	// Trim forgets what no decision at or after now needs.
	Trim(p Params, now int64)
	// Earliest is the earliest instant at or after `at` at which n more
	// events fit.
	Earliest(p Params, at, n int64) int64
	// Record counts n events at `at`, where they fit, and returns what
	// GiveBack needs to uncount exactly them.
	Record(p Params, at, n int64) string
	// GiveBack uncounts the n events that Record described as pieces.
	GiveBack(p Params, pieces string, n int64)
	// Room is how many more events fit at `at`.
	Room(p Params, at int64) int64
	// ResetAfter is how long from `at` until the state is back to its
	// initial value.
	ResetAfter(p Params, at int64) int64
	// Empty reports whether the state counts nothing (once trimmed).
	Empty() bool
	// Used is what the state counted at or before now: what a limit that
	// replaces p takes over (see TakeOver).
	Used(p Params, now int64) Used
	// Seed counts u in an empty state, at now.
	Seed(p Params, now int64, u Used)
}

// Used is what a state counted at or before an instant, for a state of
// the same algorithm under other Params to take over: the windows' events
// at their instants (a counter's at the end of their sub-window, or now if
// sooner), a bucket's server time still taken from that instant on, in µs
// (rounded up). Turns booked after the instant are not in it: their tasks
// book them again at the new limit.
type Used struct {
	Events []Event
	Busy   int64
}

// Event is N events counted at At (µs).
type Event struct{ At, N int64 }

// TakeOver seeds s, under p, from old, under q, at now, if s counts
// nothing: a limit changed live (p replaces q) keeps what q counted at or
// before now, so that a raise grants no burst q's use had not left, and a
// cut lets nothing through above p. It reports whether it seeded s; the
// caller carries old's block over then. Both are trimmed.
func TakeOver(s State, p Params, old State, q Params, now int64) bool {
	s.Trim(p, now)
	if !s.Empty() {
		return false
	}
	old.Trim(q, now)
	s.Seed(p, now, old.Used(q, now))
	s.Trim(p, now)
	return true
}

// Claim is n events asked of one key's state.
type Claim struct {
	State   State
	Params  Params
	Blocked int64 // µs until which the key counts nothing (0: not blocked)
	N       int64
	// GiveBack, if not empty, is the pieces of n events booked earlier
	// that are given back before anything is booked (a turn that moves).
	GiveBack string
	// ID, if not empty, names the turn: Book keeps a turn it books in the
	// future under ID, and Kept is what the key keeps under ID now (nil:
	// nothing), looked up by the caller.
	ID   string
	Kept *Kept
}

// Kept is a turn kept under its ID: its instant and what giving it back
// gives back.
type Kept struct {
	At     int64
	Pieces string
}

// Booking is the outcome of Book.
type Booking struct {
	OK bool
	// Kept: the turns are those the claims kept under their IDs; nothing
	// was counted.
	Kept bool
	// Reminded: the turn was noted as the Op's Remind asked.
	Reminded bool
	Now      int64 // the instant it was decided at
	// At is the instant every claim was counted at; when not OK, the
	// earliest instant found at which all would fit (a lower bound).
	At     int64
	Claims []Counted // one per claim, in order
}

// Counted is what a booking did to one claim. Times are µs from now.
type Counted struct {
	Remaining  int64  // events that still fit (at At when OK, now when not)
	RetryAfter int64  // the wait after which the claim alone would fit; 0 when OK
	ResetAfter int64  // until the key is back to its initial state
	Pieces     string // OK: what GiveBack needs
	// Keep: keep {At, Pieces} under the claim's ID until At + late. Forget:
	// drop what is kept under it.
	Keep, Forget bool
}

// maxPasses bounds the search for a common instant. Each claim's earliest
// turn only moves forward as the instant asked about does, so the search
// settles in about as many passes as there are claims; a search that has
// not settled by then is reported as a wait until where it got to.
const maxPasses = 16

// Book counts the claims' events at the earliest instant, not before
// notBefore and not before any claim's block, at which every one of them
// fits, if that is at most maxWait µs from now (maxWait 0: now or never).
// With exact, that instant must be notBefore itself. It counts all the
// claims or none: the Go twin of the "book" operation of lua/book.lua.
//
// When every claim has a turn kept under its ID, all at one instant that
// has not passed by more than late µs (late < 0: however long ago), that
// turn is the booking and nothing is counted; turns kept otherwise are
// given back and forgotten, and the claims booked anew. A turn booked
// more than keepAfter µs away (>= 0) is to be kept under the claims' IDs
// (Counted.Keep).
func Book(claims []Claim, now, notBefore, maxWait int64, exact bool, late, keepAfter int64) Booking {
	b := Booking{Now: now, Claims: make([]Counted, len(claims))}
	for i := range claims {
		c := &claims[i]
		c.State.Trim(c.Params, now)
		if c.GiveBack != "" {
			c.State.GiveBack(c.Params, c.GiveBack, c.N)
			if c.ID != "" { // a turn given back is no longer kept: it moves
				c.Kept, b.Claims[i].Forget = nil, true
			}
		}
	}
	if at, ok := keptTurn(claims, now, late); ok {
		b.OK, b.Kept, b.At = true, true, at
		for i, c := range claims {
			b.Claims[i] = Counted{
				Pieces:     c.Kept.Pieces,
				Remaining:  c.State.Room(c.Params, at),
				ResetAfter: max(0, at-now) + c.State.ResetAfter(c.Params, max(at, now)),
			}
		}
		return b
	}
	for i, c := range claims {
		if c.Kept != nil {
			c.State.GiveBack(c.Params, c.Kept.Pieces, c.N)
			b.Claims[i].Forget = true
		}
	}
	forgotten := make([]bool, len(claims))
	for i := range claims {
		forgotten[i] = b.Claims[i].Forget
	}
	start := max(now, notBefore)
	at, settled := search(claims, now, start, maxWait, b.Claims)
	b.At = at
	if !settled || at-now > maxWait || (exact && at != start) {
		for i, c := range claims {
			from := max(start, c.Blocked)
			if from == now {
				b.Claims[i].Remaining = c.State.Room(c.Params, now)
			}
			b.Claims[i].ResetAfter = max(from-now, c.State.ResetAfter(c.Params, now))
		}
		return b
	}
	b.OK = true
	for i, c := range claims {
		b.Claims[i] = record(c, now, at)
		b.Claims[i].Keep = c.ID != "" && at-now > keepAfter
		b.Claims[i].Forget = forgotten[i]
	}
	return b
}

// search is the earliest instant, from start on, at which every claim
// fits, and whether it was found within maxWait µs of now; counted gets
// each claim's own wait (RetryAfter). A block beyond maxWait refuses
// without a search.
func search(claims []Claim, now, start, maxWait int64, counted []Counted) (at int64, settled bool) {
	// Each claim alone first: its own wait tells a caller which limit
	// refused.
	at = start
	for i, c := range claims {
		from := max(start, c.Blocked)
		own := from
		if from-now <= maxWait {
			own = c.State.Earliest(c.Params, from, c.N)
		}
		counted[i].RetryAfter = own - now
		at = max(at, own)
	}
	// One claim's own earliest turn is the turn.
	settled = len(claims) == 1 && at-now <= maxWait
	for pass := 0; !settled && pass < maxPasses && at-now <= maxWait; pass++ {
		next := at
		for _, c := range claims {
			if next = c.State.Earliest(c.Params, next, c.N); next-now > maxWait {
				break
			}
		}
		if next == at {
			settled = true
			break
		}
		at = next
	}
	return at, settled
}

// record counts c's events at at, decided at now.
func record(c Claim, now, at int64) Counted {
	return Counted{
		Pieces:     c.State.Record(c.Params, at, c.N),
		Remaining:  c.State.Room(c.Params, at),
		ResetAfter: at - now + c.State.ResetAfter(c.Params, at),
	}
}

// MaxSeries bounds the turns of one Series: one script run books them all,
// and holds the server meanwhile.
const MaxSeries = 1024

// Series books turns one after another on claims: what that many Books of
// the claims at now, not before notBefore and at most maxWait µs away,
// each with every claim's ID naming its turn and nothing kept under it,
// would book, in order. It stops at the first turn that is not OK or is
// less than minAhead µs from now (its time has come: its caller books it
// with Book), counting nothing for it and the turns after it, and returns
// the booked ones (Keep set where a turn is after now). The claims' ID,
// Kept and GiveBack are not read. The twin of lua/series.lua.
//
// throttled is, per claim, the events the claim's own limit throttled in
// the booked turns: its N for each turn at which the claim alone would
// have come later than the turn's start (max(now, notBefore)), what
// lua/book.lua counts as a recent throttle of that turn's Book, and
// lua/series.lua counts once for the series. The turn the series stops at
// is not in it: its caller's Book counts it.
func Series(claims []Claim, turns int, now, notBefore, maxWait, minAhead int64) (booked []Booking, throttled []int64) {
	for _, c := range claims {
		c.State.Trim(c.Params, now)
	}
	start := max(now, notBefore)
	throttled = make([]int64, len(claims))
	for range turns {
		b := Booking{OK: true, Now: now, Claims: make([]Counted, len(claims))}
		at, settled := search(claims, now, start, maxWait, b.Claims)
		if !settled || at-now > maxWait || at-now < minAhead {
			break
		}
		b.At = at
		for i, c := range claims {
			if b.Claims[i].RetryAfter > start-now { // the claim's own turn, from now
				throttled[i] += c.N
			}
			b.Claims[i] = record(c, now, at)
			b.Claims[i].Keep = at > now
		}
		booked = append(booked, b)
	}
	return booked, throttled
}

// keptTurn is the instant of the turn every claim keeps under its ID, if
// they all keep one there and it has not passed by more than late.
func keptTurn(claims []Claim, now, late int64) (int64, bool) {
	if len(claims) == 0 {
		return 0, false
	}
	for _, c := range claims {
		if c.Kept == nil || c.Kept.At != claims[0].Kept.At {
			return 0, false
		}
	}
	at := claims[0].Kept.At
	return at, late < 0 || at >= now-late
}

// Peek is how many events fit now, how long the key is still blocked and
// how long until what it counted has passed: the Go twin of the "peek"
// operation.
func Peek(s State, p Params, now, blocked int64) (room, blockedFor, resetAfter int64) {
	s.Trim(p, now)
	resetAfter = s.ResetAfter(p, now)
	if blocked > now {
		return 0, blocked - now, resetAfter
	}
	return s.Room(p, now), 0, resetAfter
}

// Algorithm ties an algorithm's name to its initial state.
type Algorithm struct {
	Name     string
	NewState func() State
	// Capacity is the largest n a single call can ever be admitted with.
	Capacity func(p Params) int64
}

func limitCapacity(p Params) int64 { return p.Limit }
func burstCapacity(p Params) int64 { return p.Burst }

// FairShare is not a limit but a queue's share among the values of a key
// (see lua/fair.lua): Burst is the depth of the drain's future shared,
// Windows the claim's weight. It runs only in Redis: it has no state in
// Go, and callers let a claim of it through when Redis fails.
var FairShare = &Algorithm{Name: "fair_share", Capacity: burstCapacity}

// All lists the five algorithms.
var All = []*Algorithm{FixedWindow, SlidingLog, SlidingCounter, TokenBucket, LeakyBucket}

// ByName returns the algorithm called name, or nil.
func ByName(name string) *Algorithm {
	for _, a := range All {
		if a.Name == name {
			return a
		}
	}
	return nil
}

// ParamError says which field of Params cannot be run exactly, and why.
type ParamError struct {
	Field   string // Limit, Period, Burst or Windows
	Problem string // "must be > 0, got -3"
}

// Error implements error.
func (e *ParamError) Error() string { return e.Field + " " + e.Problem }

// maxBucketWindow bounds Burst × Period of a bucket: its state counts in
// units of that size, and positions up to twice it away must stay exact.
const maxBucketWindow = 1 << 50

// Check reports the first way in which p cannot be run exactly by a.
func (a *Algorithm) Check(p Params) *ParamError {
	bad := func(field, format string, args ...any) *ParamError {
		return &ParamError{Field: field, Problem: fmt.Sprintf(format, args...)}
	}
	switch {
	case p.Limit <= 0:
		return bad("Limit", "must be > 0, got %d", p.Limit)
	case p.Limit >= MaxExact:
		return bad("Limit", "must be below 2^53, got %d", p.Limit)
	case p.Period < 1000:
		return bad("Period", "must be at least 1ms, got %dµs", p.Period)
	case p.Period >= MaxExact/1000:
		return bad("Period", "must be below 2^53 ns, got %dµs", p.Period)
	}
	switch a {
	case SlidingCounter:
		if p.Windows < 1 || p.Windows > maxWindows {
			return bad("Windows", "must be between 1 and %d, got %d", maxWindows, p.Windows)
		}
		if p.Period%p.Windows != 0 {
			return bad("Windows", "must divide Period into whole microseconds, got Period %dµs / Windows %d", p.Period, p.Windows)
		}
	case SlidingLog:
		if p.Limit > maxLogLimit {
			return bad("Limit", "must be at most %d for sliding_log, which keeps one entry per event (use sliding_counter above that), got %d", maxLogLimit, p.Limit)
		}
	case TokenBucket, LeakyBucket:
		if p.Burst <= 0 {
			return bad("Burst", "must be >= 0 (0 means Limit), got %d", p.Burst)
		}
		if p.Burst > maxBucketWindow/p.Period {
			return bad("Burst", "× Period must stay below 2^50 µs, got %d × %dµs; lower Burst or Period", p.Burst, p.Period)
		}
	}
	return nil
}

// floorDiv and ceilDiv divide by a positive b, rounding toward minus and
// plus infinity; a may be negative.
func floorDiv(a, b int64) int64 {
	q := a / b
	if a%b != 0 && a < 0 {
		q--
	}
	return q
}

func ceilDiv(a, b int64) int64 {
	q := a / b
	if a%b != 0 && a > 0 {
		q++
	}
	return q
}

func gcd(a, b int64) int64 {
	for b != 0 {
		a, b = b, a%b
	}
	return a
}

// ints parses the space-separated integers of s, as the scripts write
// them; nil if s is empty or malformed.
func ints(s string) []int64 {
	fields := strings.Fields(s)
	out := make([]int64, len(fields))
	for i, f := range fields {
		v, err := strconv.ParseInt(f, 10, 64)
		if err != nil {
			return nil
		}
		out[i] = v
	}
	return out
}

func joinInts(vs ...int64) string {
	var buf [64]byte // a quick booking's pieces fit: one allocation, the string's
	b := buf[:0]
	for i, v := range vs {
		if i > 0 {
			b = append(b, ' ')
		}
		b = strconv.AppendInt(b, v, 10)
	}
	return string(b)
}
