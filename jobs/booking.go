package jobs

import (
	"context"
	"errors"
	"time"

	"github.com/hibiken/asynq"

	"github.com/sluicehq/sluice/throttle"
)

// lateTolerance is how long after its instant a kept turn may still be
// used: none. A task back for its turn after it (the queue was paused, the
// fleet down or too busy) books again. A turn used late comes right before
// the next one, used on time: on a drain of 1,000/s, turns used 40ms late
// put 1,040 requests into a second. Tasks come back requeueLead before
// their turn, so only those delayed that long book again; and a task back
// late is taken before the queue's backlog (see ready), so it is rare.
const lateTolerance = 0

// booking is what a task's gates gave it.
type booking struct {
	gates []*gate
	turns []throttle.Reservation // one per gate: given back if the task will not use them
	ready time.Time              // on our clock: when its turns come (zero: it has no gates)
	// askIn, if > 0, is how soon to ask the gates again: no turn within
	// worker.reserve_max, or Redis could not decide.
	askIn time.Duration
}

// bookingID names a task's turns in the limiters: the same for the task
// and for the copies it may go back to Redis as, so that a task back for
// its turns gets them (throttle.Claim.ID).
func bookingID(queue, id string, t *asynq.Task) string {
	if origin := t.Headers()[headerOrigin]; origin != "" {
		id = origin
	}
	return queue + "/" + id
}

// book gives the task one turn on all its rate gates at once: the earliest
// instant at which every one of them admits it (throttle.Book). A task back
// for turns it booked before gets them under its booking ID, counting
// nothing; back too late for them, or after a gate changed, it books anew
// and what it held is given back, in the same step.
func (s *Scheduler) book(ctx context.Context, gs *gateSet, queue, id string, t *asynq.Task) (booking, error) {
	gates := gs.gatesOf(queue, t.Type())
	if len(gates) == 0 {
		return booking{}, nil
	}
	cost, bid := gs.cost(t.Type()), bookingID(queue, id, t)
	if b, ok := s.lent(ctx, gs, gates, cost, t); ok {
		return b, nil
	}
	claims := make([]throttle.Claim, len(gates))
	for i, g := range gates {
		claims[i] = throttle.Claim{Limiter: g.lim, Key: g.key, N: cost, ID: bid}
	}
	s.metrics.bookings.WithLabelValues(queue).Inc()
	start := time.Now()
	bk, err := throttle.Book(ctx, claims, time.Time{}, gs.cfg.Worker.ReserveMax, throttle.MaxLate(lateTolerance))
	elapsed := time.Since(start).Seconds()
	for _, g := range gates {
		s.metrics.evaluations.WithLabelValues(g.name).Inc()
		s.metrics.scriptSeconds.WithLabelValues(g.name).Observe(elapsed)
	}
	if errors.Is(err, throttle.ErrRedisDenied) {
		// The task waits in Redis, not in a slot, and asks again soon.
		for _, g := range gates {
			s.metrics.redisErrors.WithLabelValues(g.name).Inc()
			if g.limit.OnRedisError == OnRedisErrorDeny {
				s.metrics.fallbacks.WithLabelValues(g.name, OnRedisErrorDeny).Inc()
			}
		}
		s.logRedisError(queue, err)
		return booking{askIn: redisRetry}, nil
	}
	if err != nil {
		return booking{}, err
	}
	for i, g := range gates {
		if fb := bk.Turns[i].Fallback; fb != "" {
			s.metrics.redisErrors.WithLabelValues(g.name).Inc()
			s.metrics.fallbacks.WithLabelValues(g.name, fb).Inc()
		}
	}
	if !bk.OK {
		// The gate that needs the longest wait is the one that deferred.
		refused := 0
		for i, turn := range bk.Turns {
			if turn.Delay > bk.Turns[refused].Delay {
				refused = i
			}
		}
		s.metrics.decisions.WithLabelValues(gates[refused].name, "deferred").Inc()
		return booking{askIn: max(bk.Delay-gs.cfg.Worker.ReserveMax, 0) + time.Second}, nil
	}
	result := "now"
	switch {
	case bk.Kept:
		result = "held"
	case bk.Delay > 0:
		result = "reserved"
	}
	for i, g := range gates {
		s.metrics.decisions.WithLabelValues(g.name, result).Inc()
		if !bk.Kept {
			s.metrics.remaining.WithLabelValues(g.name).Set(float64(bk.Turns[i].Remaining))
		}
	}
	s.log.Debug("booked", "queue", queue, "at", bk.At.UnixMicro(), "delay", bk.Delay, "kept", bk.Kept)
	// The wait is the script's own, from when its answer came: no clock but
	// Redis's is involved (the answer's way back makes it a little late,
	// never early).
	return booking{gates: gates, turns: bk.Turns, ready: s.clock.Now().Add(bk.Delay)}, nil
}

// lent gives a task that never booked before a turn lent by its gates' pool
// (throttle.Pool): most tasks of gates far from their limits go without a
// round trip to Redis. A task back from Redis books: it may hold turns under
// its booking ID. A pool that cannot lend now (its gates near their limits,
// or Redis failing) leaves the task to book.
func (s *Scheduler) lent(ctx context.Context, gs *gateSet, gates []*gate, cost int, t *asynq.Task) (booking, bool) {
	if n, _ := asynq.GetRetryCount(ctx); n > 0 || t.Headers()[headerOrigin] != "" {
		return booking{}, false
	}
	pool := gs.poolOf(gates, cost)
	if pool == nil {
		return booking{}, false
	}
	if ok, err := pool.Take(ctx); err != nil || !ok {
		return booking{}, false
	}
	for _, g := range gates {
		s.metrics.decisions.WithLabelValues(g.name, "lent").Inc()
	}
	// A lent turn cannot be given back alone: a task that does not use it
	// leaves it counted (see giveBack).
	return booking{ready: s.clock.Now()}, true
}

// giveBack gives back the turns of a task that will not use them, so that
// another task may.
func (s *Scheduler) giveBack(ctx context.Context, b booking) {
	ctx = context.WithoutCancel(ctx)
	for i, g := range b.gates {
		s.metrics.evaluations.WithLabelValues(g.name).Inc()
		if err := g.lim.Cancel(ctx, g.key, b.turns[i]); err != nil {
			s.log.Warn("cannot give back a turn; it is lost", "gate", g.name, "err", err)
		}
	}
}
