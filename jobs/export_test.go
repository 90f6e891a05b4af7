package jobs

import "time"

// WithSlotLease sets the lease of concurrency slots (30s otherwise), so
// that tests can make one end.
func WithSlotLease(d time.Duration) Option { return func(s *Scheduler) { s.slotLease = d } }

// withWorker names the Scheduler's worker: schedulers of one test process
// are a fleet's workers only with names of their own.
func withWorker(name string) Option { return func(s *Scheduler) { s.worker = name } }
