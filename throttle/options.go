package throttle

import (
	"fmt"
	"strings"
)

// Option configures New and NewLocal.
type Option func(*options) error

type options struct {
	clock        Clock
	prefix       string
	inFlight     int
	onRedisError string
	shares       func() int
	recent       bool
	replaces     Limiter
}

// WithClock makes the limiter read time from c instead of Redis's clock (New)
// or the system clock (NewLocal). Meant for tests: a fleet should share
// Redis's clock.
func WithClock(c Clock) Option {
	return func(o *options) error {
		o.clock = c
		return nil
	}
}

// stateVersion names the layout of the states the scripts keep: limiters
// of a version that keeps them otherwise must not read them.
const stateVersion = "v2"

// WithPrefix sets the namespace of the limiter's keys (default
// "sluice:<algorithm>:v2:", v2 the layout of the state). Limiters that must not share state need different
// prefixes; limiters of different algorithms already have them. The prefix
// may not contain '{' or '}', which would move its keys' hash tag.
func WithPrefix(prefix string) Option {
	return func(o *options) error {
		if strings.ContainsAny(prefix, "{}") {
			return fmt.Errorf("%w: WithPrefix(%q) must not contain '{' or '}'", ErrInvalidSpec, prefix)
		}
		o.prefix = prefix
		return nil
	}
}

// WithPipelining sets how many script calls a Redis limiter has on the wire
// at once (default 4). A call made while that many are out waits, and goes
// out with every other waiting call in one pipeline as soon as one comes
// back: under load, many decisions share one round trip, which saves the
// client and the server a write and a read per decision. Fewer concurrent
// callers than that never wait for each other. 0 turns it off: every call
// is its own round trip at once, on its own pooled connection. Each
// decision is its own atomic script run either way. NewLocal ignores it.
func WithPipelining(maxInFlight int) Option {
	return func(o *options) error {
		if maxInFlight < 0 {
			return fmt.Errorf("%w: WithPipelining(%d): the calls in flight must be >= 0 (0 turns pipelining off)", ErrInvalidSpec, maxInFlight)
		}
		o.inFlight = maxInFlight
		return nil
	}
}

// WithRecentThrottles makes a Redis limiter (New, NewSemaphore) count, for
// each key, the events it throttled in the last minute: a book that its
// own limit could not give the instant asked for (whether it booked a
// later turn or refused), a semaphore's refused Acquire. The count lives
// next to the key's state, in its cluster slot, in one small string that
// expires a minute after the key's last throttle; it is written by the
// script call that throttles, so it costs no round trip. Loads reads it.
// NewLocal ignores it.
func WithRecentThrottles() Option {
	return func(o *options) error {
		o.recent = true
		return nil
	}
}

// Replacing makes the limiter the successor of old, a limiter of the same
// algorithm and engine under another Spec and prefix (a limit changed
// live): a key whose state counts nothing takes over what old counted for
// it at or before that instant, and old's block, in the same atomic step
// (algorithms.TakeOver). A raise then grants no burst that old's use had
// not left, and a cut lets nothing through above the new limit. Turns old
// booked ahead are not taken over (a bucket's within its window excepted):
// their callers book them again. Counted under old later (a fleet's
// workers change over one by one) is not seen.
func Replacing(old Limiter) Option {
	return func(o *options) error {
		o.replaces = old
		return nil
	}
}

// replacedOf checks that c can replace old (see Replacing).
func replacedOf(c compiled, old compiled) error {
	if c.algorithm != old.algorithm {
		return fmt.Errorf("%w: Replacing: a %s limiter cannot take over the state of a %s one", ErrInvalidSpec, c.algorithm.Name, old.algorithm.Name)
	}
	return nil
}

func applyOptions(spec Spec, opts []Option) (options, error) {
	o := options{prefix: "sluice:" + string(spec.Algorithm) + ":" + stateVersion + ":", inFlight: defaultInFlight, onRedisError: OnRedisErrorDeny}
	for _, opt := range opts {
		if err := opt(&o); err != nil {
			return o, err
		}
	}
	return o, nil
}
