// Package throttle answers one question for sluice and for any Go service:
// may n events for this key happen now, and if not, exactly when?
//
// It offers five algorithms (fixed window, sliding window log, sliding window
// counter, token bucket, leaky bucket) on two engines with the same
// decisions: New runs each decision as one atomic Lua script on Redis or
// Redis Cluster, with Redis's clock, so a whole fleet shares one limit;
// NewLocal runs it in process.
//
//	lim, err := throttle.New(rdb, throttle.Spec{Algorithm: throttle.TokenBucket, Limit: 10, Period: time.Second})
//	d, err := lim.AllowN(ctx, "api:alice", 1)
//	if !d.Allowed {
//		time.Sleep(d.RetryAfter)
//	}
//
// A denial is a Decision, not an error; errors mean bad input
// (ErrInvalidSpec, ErrInvalidCost, ErrMisuse) or a failed backend.
package throttle

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/sluicehq/sluice/algorithms"
)

// Algorithm names a rate-limit algorithm.
type Algorithm string

// The five algorithms. Each admits at most Limit events per Period; they
// differ in how they see time.
const (
	// FixedWindow counts events in windows [k*Period, (k+1)*Period) since the
	// Unix epoch. Cheapest; allows up to 2*Limit across a window boundary.
	FixedWindow Algorithm = "fixed_window"
	// SlidingLog admits at most Limit events in any interval (t-Period, t].
	// Exact; keeps one entry per admitted event.
	SlidingLog Algorithm = "sliding_log"
	// SlidingCounter sums the counts of the last Windows sub-windows of
	// Period/Windows each. Nearly as smooth as SlidingLog with Windows counters.
	SlidingCounter Algorithm = "sliding_counter"
	// TokenBucket starts with Burst tokens and refills continuously at
	// Limit per Period; an event takes a token.
	TokenBucket Algorithm = "token_bucket"
	// LeakyBucket starts empty and leaks continuously at Limit per Period; an
	// event fits while the level stays within Burst. With Burst 1 events are
	// spaced exactly Period/Limit apart.
	LeakyBucket Algorithm = "leaky_bucket"
)

// Algorithms lists the five algorithms.
var Algorithms = []Algorithm{FixedWindow, SlidingLog, SlidingCounter, TokenBucket, LeakyBucket}

// Spec describes one limit.
type Spec struct {
	Algorithm Algorithm
	Limit     int           // events per Period
	Period    time.Duration // at least 1ms, in whole microseconds
	Burst     int           // token_bucket: capacity; leaky_bucket: bucket size; 0 means Limit
	Windows   int           // sliding_counter: sub-windows per Period; 0 means 10
}

// Decision is the answer to one AllowN call.
//
// For a token bucket of Limit 10 per second and Burst 5 that has just
// admitted 5 events: Allowed is false for the next one, Remaining is 0,
// RetryAfter is 100ms (one token's time) and ResetAfter is 500ms (until the
// bucket is full again).
type Decision struct {
	Allowed    bool
	Remaining  int           // events that could still be admitted now
	RetryAfter time.Duration // 0 when allowed; when denied: the exact wait after which the same call is allowed if nothing else happens
	ResetAfter time.Duration // until the key is back to its initial state
}

// Limiter decides whether events may happen.
type Limiter interface {
	// AllowN reports whether n events for key may happen now and, if they
	// may, records them. A denied call records nothing.
	AllowN(ctx context.Context, key string, n int) (Decision, error)
}

// Clock tells the time and wakes its reader after a wait: the one clock of
// the limiters, their Pools and the jobs package's Scheduler. By default
// the Redis engine uses Redis's clock and the local engine and Pools the
// system clock (SystemClock); tests inject one they move by hand (WithClock,
// PoolClock), whose waits end when they move it past them.
type Clock interface {
	Now() time.Time
	// After sends the time on the channel once d has passed.
	After(d time.Duration) <-chan time.Time
}

// SystemClock is the system's clock: time.Now and time.After.
type SystemClock struct{}

// Now returns time.Now().
func (SystemClock) Now() time.Time { return time.Now() }

// After returns time.After(d).
func (SystemClock) After(d time.Duration) <-chan time.Time { return time.After(d) }

// Errors for bad input, wrapped with a message that names the field at fault.
var (
	// ErrInvalidSpec is wrapped by New and NewLocal when the Spec is unusable.
	ErrInvalidSpec = errors.New("throttle: invalid spec")
	// ErrInvalidCost is wrapped by AllowN (and the calls that take a cost)
	// when n <= 0 or n could never be admitted (more than Limit, or than
	// Burst for the buckets).
	ErrInvalidCost = errors.New("throttle: invalid cost")
	// ErrMisuse is wrapped when a call's other arguments cannot be acted
	// on: a negative maxWait, two claims of one Book on one key, a Cancel
	// of a reservation that counted nothing or without what its call
	// returned.
	ErrMisuse = errors.New("throttle: misuse")
)

// SpecError is the error New and NewLocal return for an unusable Spec. It
// wraps ErrInvalidSpec.
type SpecError struct {
	Field   string // the Spec field at fault: Algorithm, Limit, Period, Burst or Windows
	Problem string // what is wrong with it and what would be right
}

// Error implements error.
func (e *SpecError) Error() string {
	return fmt.Sprintf("%v: Spec.%s %s", ErrInvalidSpec, e.Field, e.Problem)
}

// Unwrap returns ErrInvalidSpec.
func (e *SpecError) Unwrap() error { return ErrInvalidSpec }

// WithDefaults returns s with every zero field that has a default set to
// it: Burst to Limit, Windows to 10. Validate and New apply it; it is
// exported so that callers that show a spec show what will run.
func (s Spec) WithDefaults() Spec {
	if s.Burst == 0 {
		s.Burst = s.Limit
	}
	if s.Windows == 0 {
		s.Windows = 10
	}
	return s
}

// Validate reports the first problem that makes s unusable, as a
// *SpecError naming the field; nil if New and NewLocal would accept it.
func (s Spec) Validate() error {
	_, err := compile(s)
	return err
}

// compiled is a validated Spec in the units the algorithms use.
type compiled struct {
	algorithm *algorithms.Algorithm
	params    algorithms.Params
	capacity  int64 // the largest n ever admitted
	horizon   int64 // µs: the furthest ahead a turn is ever booked
}

// maxHorizon bounds how far ahead a turn is booked, for every limit:
// further than anyone plans a task.
const maxHorizon = int64(24 * time.Hour / time.Microsecond)

func compile(spec Spec) (compiled, error) {
	bad := func(field, format string, args ...any) (compiled, error) {
		return compiled{}, &SpecError{Field: field, Problem: fmt.Sprintf(format, args...)}
	}
	algorithm := algorithms.ByName(string(spec.Algorithm))
	if algorithm == nil {
		return bad("Algorithm", "must be one of %v, got %q", Algorithms, spec.Algorithm)
	}
	if spec.Period%time.Microsecond != 0 {
		return bad("Period", "must be a whole number of microseconds, got %v", spec.Period)
	}
	if spec.Burst < 0 {
		return bad("Burst", "must be >= 0 (0 means Limit), got %d", spec.Burst)
	}
	if spec.Windows < 0 {
		return bad("Windows", "must be >= 0 (0 means 10), got %d", spec.Windows)
	}
	spec = spec.WithDefaults()
	p := algorithms.Params{
		Limit:   int64(spec.Limit),
		Period:  spec.Period.Microseconds(),
		Burst:   int64(spec.Burst),
		Windows: int64(spec.Windows),
	}
	if algorithm == algorithms.FixedWindow {
		p.Windows = 1 // a fixed window is a sliding counter of one sub-window
	}
	if err := algorithm.Check(p); err != nil {
		return bad(err.Field, "%s", err.Problem)
	}
	c := compiled{algorithm: algorithm, params: p, capacity: algorithm.Capacity(p), horizon: maxHorizon}
	switch algorithm {
	case algorithms.TokenBucket, algorithms.LeakyBucket:
		// A bucket counts time in units of 1/(Limit/g) µs: turns further
		// ahead than this would not be counted exactly.
		perMicro := p.Limit / gcd(p.Limit, p.Period)
		c.horizon = min(c.horizon, (1<<51)/perMicro)
	case algorithms.SlidingLog:
		// A decision may walk every event booked ahead: at most about
		// maxAheadEvents of them.
		c.horizon = min(c.horizon, p.Period*max(1, maxAheadEvents/p.Limit))
	case algorithms.FixedWindow, algorithms.SlidingCounter:
		// A decision reads every sub-window booked in: at most about
		// maxAheadWindows ahead.
		c.horizon = min(c.horizon, p.Period/p.Windows*maxAheadWindows)
	}
	return c, nil
}

// The most state a limiter books ahead, so that one decision stays within
// a few milliseconds of Redis time (see docs/benchmarks.md, "throttle: decisions per second"):
// reservations further ahead are refused (their Delay says when to ask
// again).
const (
	maxAheadEvents  = 20_000 // sliding_log: events
	maxAheadWindows = 2_000  // fixed_window, sliding_counter: (sub-)windows
)

func gcd(a, b int64) int64 {
	for b != 0 {
		a, b = b, a%b
	}
	return a
}

func (c compiled) checkCost(n int) error {
	if n <= 0 {
		return fmt.Errorf("%w: n must be > 0, got %d", ErrInvalidCost, n)
	}
	if int64(n) > c.capacity {
		field := "Limit"
		if c.algorithm == algorithms.TokenBucket || c.algorithm == algorithms.LeakyBucket {
			field = "Burst"
		}
		return fmt.Errorf("%w: n = %d can never be admitted by %s with %s %d", ErrInvalidCost, n, c.algorithm.Name, field, c.capacity)
	}
	return nil
}

// Capacity is the largest n a single call on spec can ever be admitted
// with (Burst for the buckets, Limit otherwise), or 0 if spec is invalid.
func (s Spec) Capacity() int {
	c, err := compile(s)
	if err != nil {
		return 0
	}
	return int(c.capacity)
}

func micros(us int64) time.Duration { return time.Duration(us) * time.Microsecond }

// unixMicros is t in µs since the Unix epoch, 0 for the zero Time.
func unixMicros(t time.Time) int64 {
	if t.IsZero() {
		return 0
	}
	return t.UnixMicro()
}
