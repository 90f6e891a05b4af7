package jobs

import "time"

// Clock tells the Scheduler the time and wakes it after a wait. The
// system clock by default; tests inject a manual one (WithClock), and then
// the gates' limiters read it too, instead of Redis's clock.
type Clock interface {
	Now() time.Time
	// After sends the time on the channel once d has passed.
	After(d time.Duration) <-chan time.Time
}

type systemClock struct{}

func (systemClock) Now() time.Time                         { return time.Now() }
func (systemClock) After(d time.Duration) <-chan time.Time { return time.After(d) }

// Option configures NewScheduler.
type Option func(*Scheduler)

// WithClock makes the Scheduler and its gates run on c. For tests: a fleet
// should share Redis's clock.
func WithClock(c Clock) Option { return func(s *Scheduler) { s.clock, s.injected = c, true } }
