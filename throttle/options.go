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
	stateOf      Limiter
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
const stateVersion = "v3"

// WithPrefix sets the namespace of the limiter's keys (default
// "sluice:<layout>:v3:", layout the spec's StateLayout and v3 the
// scripts'). Limiters that must not share state need different prefixes;
// limiters whose states are kept otherwise already have them. Limiters of
// different StateLayouts must not be given one prefix. The prefix may not
// contain '{' or '}', which would move its keys' hash tag.
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

// WithStateOf makes the limiter keep its state where l keeps its own, and
// go on from what l counted: a limit changed live (a new Spec for the same
// keys) keeps what was used under the old one, each limiter counting it
// at its own limit, and a turn booked under the old Spec is given back
// when its caller books again under its ID (Claim.ID), not used: it was
// booked at the old rate. The Specs must have one StateLayout, and l be of
// the same engine (New: l's prefix is taken; NewLocal: l's memory).
func WithStateOf(l Limiter) Option {
	return func(o *options) error {
		o.stateOf = l
		return nil
	}
}

// StateLayout names how limiters of spec keep their state: limiters whose
// Specs have one StateLayout read each other's states (see WithStateOf).
// It is the algorithm, and what its state is counted in: the sub-window
// of fixed_window and sliding_counter (a Period or Windows that changes
// it starts a new state), the unit of a bucket's time, 1/(Limit/g) µs for
// g = gcd(Limit, Period in µs) (1 µs when Limit divides the Period's µs,
// as 1 to 10, 20, 25, 40, 50 and 100 a second do); sliding_log keeps
// event times, whatever its Spec.
func StateLayout(spec Spec) (string, error) {
	c, err := compile(spec)
	if err != nil {
		return "", err
	}
	return c.algorithm.LayoutOf(c.params), nil
}

// sameLayout is nil if c can read the state kept by a limiter of spec of.
func sameLayout(c, of compiled) error {
	if mine, theirs := c.algorithm.LayoutOf(c.params), of.algorithm.LayoutOf(of.params); mine != theirs {
		return fmt.Errorf("%w: WithStateOf: the state of a limiter of layout %s cannot be read by one of layout %s (see StateLayout)", ErrInvalidSpec, theirs, mine)
	}
	return nil
}

// applyOptions applies opts over the defaults of a limiter of spec (of
// the semaphore and the fair share, whose Spec only names them: their
// prefix is by name).
func applyOptions(spec Spec, opts []Option) (options, error) {
	layout := string(spec.Algorithm)
	if c, err := compile(spec); err == nil {
		layout = c.algorithm.LayoutOf(c.params)
	}
	o := options{prefix: "sluice:" + layout + ":" + stateVersion + ":", inFlight: defaultInFlight, onRedisError: OnRedisErrorDeny}
	for _, opt := range opts {
		if err := opt(&o); err != nil {
			return o, err
		}
	}
	return o, nil
}
