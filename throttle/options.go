package throttle

import (
	"fmt"
	"strings"
)

// Option configures New and NewLocal.
type Option func(*options) error

type options struct {
	clock  Clock
	prefix string
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

// WithPrefix sets the namespace of the limiter's keys (default
// "sluice:<algorithm>:"). Limiters that must not share state need different
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

func applyOptions(spec Spec, opts []Option) (options, error) {
	o := options{prefix: "sluice:" + string(spec.Algorithm) + ":"}
	for _, opt := range opts {
		if err := opt(&o); err != nil {
			return o, err
		}
	}
	return o, nil
}
