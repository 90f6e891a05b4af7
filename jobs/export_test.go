package jobs

import "time"

// WithSlotLease sets the lease of concurrency slots (30s otherwise), so
// that tests can make one end.
func WithSlotLease(d time.Duration) Option { return func(s *Scheduler) { s.slotLease = d } }
