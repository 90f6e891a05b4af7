package jobs

import (
	"context"
	"errors"
	"time"

	"github.com/hibiken/asynq"

	"github.com/sluicehq/sluice/throttle"
)

// lateTolerance is how long after its instant a turn may still be used. A
// turn used later than that (the queue was paused, the fleet down, the
// task stuck behind others) is booked again: else a backlog of old turns
// would run as one burst.
const lateTolerance = 100 * time.Millisecond

// booking is what a task's gates gave it.
type booking struct {
	turns []heldTurn // every turn the task holds, to carry if it goes back to Redis
	ready time.Time  // on our clock: when its turns come (zero: it has no gates)
	// askAt, if not zero, is when (on our clock) to ask the gates again:
	// no turn within worker.reserve_max, or a gate could not be asked.
	askAt time.Time
}

// book gives the task one turn on all its rate gates at once: the earliest
// instant at which every one of them admits it (throttle.Book). Turns the
// task already holds (it went back to Redis to wait for them) are used
// without asking again, unless a gate changed since or the turn has
// passed; then it books anew, and what it held is given back in the same
// step.
func (s *Scheduler) book(ctx context.Context, gs *gateSet, queue string, t *asynq.Task) (booking, error) {
	gates := gs.gatesOf(queue, t.Type())
	if len(gates) == 0 {
		return booking{}, nil
	}
	held := readTurns(t.Headers())
	if b, ok := s.heldBooking(ctx, gates, held); ok {
		return b, nil
	}
	now := s.clock.Now()
	cost := gs.cost(t.Type())
	claims := make([]throttle.Claim, len(gates))
	for i, g := range gates {
		claims[i] = throttle.Claim{Limiter: g.lim, Key: g.key, N: cost}
		if h, ok := held[g.tag]; ok {
			claims[i].Replaces = &h.Turn
		}
	}
	s.metrics.bookings.WithLabelValues(queue).Inc()
	start := time.Now()
	bk, err := throttle.Book(ctx, claims, time.Time{}, gs.cfg.Worker.ReserveMax)
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
		return booking{askAt: now.Add(redisRetry)}, nil
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
		return booking{askAt: now.Add(max(bk.Delay-gs.cfg.Worker.ReserveMax, 0) + time.Second)}, nil
	}
	// The wait is the script's own, from when its answer came: no clock but
	// Redis's is involved (the answer's way back makes it a little late,
	// never early).
	b := booking{ready: s.clock.Now().Add(bk.Delay)}
	s.log.Debug("booked", "queue", queue, "at", bk.At.UnixMicro(), "delay", bk.Delay)
	for i, g := range gates {
		result := "now"
		if bk.Delay > 0 {
			result = "reserved"
		}
		s.metrics.decisions.WithLabelValues(g.name, result).Inc()
		s.metrics.remaining.WithLabelValues(g.name).Set(float64(bk.Turns[i].Remaining))
		b.turns = append(b.turns, heldTurn{Gate: g.tag, Turn: bk.Turns[i]})
	}
	return b, nil
}

// heldBooking is the booking of a task that holds a turn on every one of
// its gates, at one instant that has not passed by more than lateTolerance.
func (s *Scheduler) heldBooking(ctx context.Context, gates []*gate, held map[string]heldTurn) (booking, bool) {
	if len(held) != len(gates) {
		return booking{}, false
	}
	// A turn held is an instant on Redis's clock: wait until we know how
	// ours differs.
	select {
	case <-s.clockKnown:
	case <-ctx.Done():
		return booking{}, false
	}
	now := s.clock.Now()
	var b booking
	for _, g := range gates {
		h, ok := held[g.tag]
		if !ok || (len(b.turns) > 0 && !h.Turn.At.Equal(b.turns[0].Turn.At)) {
			return booking{}, false
		}
		b.turns = append(b.turns, h)
	}
	b.ready = s.local(b.turns[0].Turn.At)
	if now.Sub(b.ready) > lateTolerance {
		s.metrics.lateTurns.Inc()
		return booking{}, false
	}
	for _, g := range gates {
		s.metrics.decisions.WithLabelValues(g.name, "held").Inc()
	}
	return b, true
}

// giveBack gives back the turns of a task that will not use them, so that
// another task may.
func (s *Scheduler) giveBack(ctx context.Context, gs *gateSet, queue, typ string, turns []heldTurn) {
	ctx = context.WithoutCancel(ctx)
	for _, g := range gs.gatesOf(queue, typ) {
		for _, h := range turns {
			if h.Gate != g.tag {
				continue
			}
			s.metrics.evaluations.WithLabelValues(g.name).Inc()
			if err := g.lim.Cancel(ctx, g.key, h.Turn); err != nil {
				s.log.Warn("cannot give back a turn; it is lost", "gate", g.name, "err", err)
			}
		}
	}
}
