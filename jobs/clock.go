package jobs

import (
	"strconv"

	"github.com/sluicehq/sluice/throttle"
)

// Clock tells the Scheduler the time and wakes it after a wait: the
// throttle package's, which the gates' limiters and pools read too. The
// system clock by default; tests inject a manual one (WithClock), and then
// the limiters read it instead of Redis's clock.
type Clock = throttle.Clock

// schedClock is the clock of the Scheduler and its services, and whether
// it was injected: an injected clock is read by the scripts too
// (scriptNow), instead of Redis's TIME.
type schedClock struct {
	Clock
	injected bool
}

// scriptNow is the time a script reads in µs: "" for Redis's own, or the
// injected clock's.
func (c schedClock) scriptNow() string {
	if c.injected {
		return strconv.FormatInt(c.Now().UnixMicro(), 10)
	}
	return ""
}

// Option configures NewScheduler.
type Option func(*Scheduler)

// WithClock makes the Scheduler and its gates run on c. For tests: a fleet
// should share Redis's clock.
func WithClock(c Clock) Option {
	return func(s *Scheduler) { s.clock = schedClock{Clock: c, injected: true} }
}
