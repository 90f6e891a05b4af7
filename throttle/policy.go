package throttle

import (
	"fmt"
	"sync"
	"time"
)

// The failure policies: what a limiter does with a call it cannot decide
// because Redis failed (WithOnRedisError). Every caller of this package uses
// these three, with one rule for dividing a limit (Divide).
const (
	// OnRedisErrorDeny fails the call with an error wrapping ErrRedisDenied
	// (the default): safest for limits that protect something that costs.
	OnRedisErrorDeny = "deny"
	// OnRedisErrorAllow lets the call through, counted nowhere:
	// availability first.
	OnRedisErrorAllow = "allow"
	// OnRedisErrorLocal decides the call on an in-process twin of the
	// limit, divided among the processes that share it (see Divide).
	OnRedisErrorLocal = "local"
)

// WithOnRedisError sets what a Redis limiter (New) does with a call that
// Redis fails: OnRedisErrorDeny (the default), OnRedisErrorAllow or
// OnRedisErrorLocal. shares, for the local policy, says how many processes
// share the limit at the moment (nil: one); the twin's limit is the
// limit divided by it (Divide). A shares that returns 0 or less does not
// know yet: the call is denied, as by OnRedisErrorDeny, until it does (a
// process that guessed would admit its guess's share beside processes it
// has not counted). NewLocal ignores the option.
func WithOnRedisError(policy string, shares func() int) Option {
	return func(o *options) error {
		switch policy {
		case OnRedisErrorDeny, OnRedisErrorAllow, OnRedisErrorLocal:
		default:
			return fmt.Errorf("%w: WithOnRedisError(%q): the policy must be %q, %q or %q", ErrInvalidSpec, policy, OnRedisErrorDeny, OnRedisErrorAllow, OnRedisErrorLocal)
		}
		o.onRedisError, o.shares = policy, shares
		return nil
	}
}

// Divide returns the share of spec that each of parts processes may use so
// that together they never admit more than spec: Limit and Burst divided
// by parts, rounded down. Where a share of Limit would be below one event,
// the share is one event and the Period is stretched to keep the rate
// (Period × parts / Limit, rounded up); a bucket's share of Burst is at
// least one event. So the shares' rates add up to at most spec's, and a
// window's count to at most spec's Limit unless Limit < parts. Divide(spec,
// 1) and parts < 1 return spec.
func Divide(spec Spec, parts int) Spec {
	if parts <= 1 {
		return spec
	}
	spec = spec.WithDefaults()
	if spec.Limit >= parts {
		spec.Limit /= parts
	} else {
		// Each process gets one event per parts/Limit Periods.
		stretched := (spec.Period*time.Duration(parts) + time.Duration(spec.Limit) - 1) / time.Duration(spec.Limit)
		spec.Period = stretched.Round(time.Microsecond)
		if spec.Period < stretched {
			spec.Period += time.Microsecond
		}
		spec.Limit = 1
	}
	spec.Burst = max(1, spec.Burst/parts)
	return spec
}

// localTwin is the in-process limit of the local policy, divided by the
// shares of the moment.
type localTwin struct {
	spec   Spec
	shares func() int
	clock  Clock

	mu      sync.Mutex
	current *localLimiter
	parts   int
}

// limiter returns the twin for the current number of shares, or nil while
// that number is not known.
func (t *localTwin) limiter() limiter {
	parts := 1
	if t.shares != nil {
		if parts = t.shares(); parts < 1 {
			return nil
		}
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.current == nil || t.parts != parts {
		c, err := compile(Divide(t.spec, parts))
		if err != nil {
			// A share of a valid spec is valid but for a Period stretched
			// past the bounds: keep the share of one process.
			c, _ = compile(Divide(t.spec, 1))
		}
		t.current, t.parts = newLocal(c, t.clock), parts
	}
	return t.current
}
