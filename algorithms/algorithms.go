// Package algorithms holds sluice's five rate-limit algorithms, each twice:
// as a pure state transition in Go (the in-process engine, and the reference
// model the Lua is tested against) and as the Redis script that makes the
// same transition atomically on the server.
//
// Everything here counts time in integer microseconds and events in whole
// numbers, so that the Go and Lua twins agree to the last microsecond.
// Callers validate Params and n (see package throttle); this package assumes
// 1 <= n <= capacity and the 2^53 bounds that Params.Check enforces.
package algorithms

import "fmt"

// MaxExact is the largest integer every intermediate value must stay below:
// Lua numbers are doubles and hold integers exactly up to 2^53.
const MaxExact = 1 << 53

// Params is the shape of one limit, in the units the transitions use.
type Params struct {
	Limit   int64 // events per Period
	Period  int64 // µs
	Burst   int64 // token_bucket and leaky_bucket: capacity in events
	Windows int64 // sliding_counter: sub-windows per Period
}

// Result is one decision. All times are µs.
type Result struct {
	Allowed    bool
	Remaining  int64 // events that could still be admitted (at At, when reserved)
	RetryAfter int64 // denied: the wait after which the same call fits if nothing else happens
	ResetAfter int64 // until the state is back to its initial value (the TTL it needs)
	Delay      int64 // allowed: how long after now the events were counted, 0 unless reserved
	At         int64 // allowed: the instant the events were counted at
}

// State is one key's state under one algorithm: the Go twin of a script's
// body. Trim forgets what has expired by now; the others never look at
// events that old.
type State interface {
	Trim(p Params, now int64)
	// Decide reports whether n more events fit at `at`, changing nothing:
	// Allowed, Remaining (after them, if they fit), RetryAfter and
	// ResetAfter from `at`.
	Decide(p Params, at, n int64) Result
	// Record counts n events at `at`.
	Record(p Params, at, n int64)
	// GiveBack uncounts n events counted at `at`.
	GiveBack(p Params, at, n int64)
}

// Allow counts n events at now if they fit: the Go twin of the scripts'
// "allow" operation. blocked is the µs until which the key is blocked (0:
// not blocked).
func Allow(s State, p Params, now, blocked, n int64) Result {
	return Reserve(s, p, now, blocked, 0, n, -1)
}

// Reserve is Allow, or else counts n events at the earliest instant they
// fit, not before notBefore, if that is at most maxWait µs from now (a
// negative maxWait never reserves): the Go twin of the scripts' "reserve"
// operation.
func Reserve(s State, p Params, now, blocked, notBefore, n, maxWait int64) Result {
	s.Trim(p, now)
	start := max(now, blocked, notBefore)
	r := s.Decide(p, start, n)
	if r.Allowed && start == now {
		s.Record(p, now, n)
		r.At = now
		return r
	}
	wait := start - now
	if !r.Allowed {
		wait += r.RetryAfter
	}
	if start > now {
		r.Remaining = 0
	}
	if wait > maxWait {
		return Result{Remaining: r.Remaining, RetryAfter: wait, ResetAfter: start - now + r.ResetAfter}
	}
	r = s.Decide(p, now+wait, n)
	if !r.Allowed {
		panic(fmt.Sprintf("algorithms: %d events did not fit at their own turn, %dµs from now", n, wait))
	}
	s.Record(p, now+wait, n)
	r.ResetAfter += wait
	r.Delay, r.At = wait, now+wait
	return r
}

// Peek returns how many events fit at now and how long the key is still
// blocked, changing nothing but what has expired: the Go twin of the
// scripts' "peek" operation.
func Peek(s State, p Params, now, blocked int64) (remaining, blockedFor int64) {
	s.Trim(p, now)
	if blocked > now {
		return 0, blocked - now
	}
	r := s.Decide(p, now, 1)
	if r.Allowed {
		return r.Remaining + 1, 0
	}
	return r.Remaining, 0
}

// Cancel gives back n events reserved at `at`: the Go twin of the scripts'
// "cancel" operation.
func Cancel(s State, p Params, now, at, n int64) {
	s.Trim(p, now)
	s.GiveBack(p, at, n)
}

// Algorithm ties an algorithm's name to its initial state and its script.
type Algorithm struct {
	Name     string
	NewState func() State
	Script   *Script
	// Capacity is the largest n a single call can ever be admitted with.
	Capacity func(p Params) int64
}

func limitCapacity(p Params) int64 { return p.Limit }
func burstCapacity(p Params) int64 { return p.Burst }

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
		if p.Windows < 1 || p.Windows > 1000 {
			return bad("Windows", "must be between 1 and 1000, got %d", p.Windows)
		}
		if p.Period%p.Windows != 0 {
			return bad("Windows", "must divide Period into whole microseconds, got Period %dµs / Windows %d", p.Period, p.Windows)
		}
	case TokenBucket, LeakyBucket:
		if p.Burst <= 0 {
			return bad("Burst", "must be >= 0 (0 means Limit), got %d", p.Burst)
		}
		// Buckets count in units of 1/Period: Burst*Period (+ one Limit of
		// refill) must stay exact in Lua.
		if p.Burst > (MaxExact-p.Limit)/p.Period {
			return bad("Burst", "× Period must stay below 2^53 µs, got %d × %dµs; lower Burst or Period", p.Burst, p.Period)
		}
	}
	return nil
}

func floorDiv(a, b int64) int64 { return a / b }

func ceilDiv(a, b int64) int64 { return (a + b - 1) / b }
