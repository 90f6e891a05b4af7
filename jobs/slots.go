package jobs

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/throttle"
)

// A task takes the concurrency slots of its queue and its type (fleet-wide
// semaphores with leases) after its turn, and holds them while its handler
// runs, renewing their leases. A lease that ends while the task runs lets
// another task take the slot: two would run where one may. So a task whose
// renews cannot reach Redis is stopped before its lease could end, and one
// told by Redis that its lease has ended takes a free slot again or is
// stopped; either is counted in sluice_slots_lost_total.

// errSlotLost ends the context of a handler whose task lost a concurrency
// slot.
var errSlotLost = errors.New("jobs: the task lost a concurrency slot: its lease ended, or would have before a renew could reach Redis")

// slot is one concurrency limit a task draws on.
type slot struct {
	sem    *throttle.Semaphore
	key    string // the semaphore's key: "queue:<name>", "type:<name>", or a key value (concurrency_key)
	label  string // "queue:<name>" or "type:<name>"
	policy string // concurrency_on_redis_error
}

// gate is the slot's label in the gate metrics.
func (sl slot) gate() string { return GateName{ConcurrencyGate, sl.label}.String() }

// slotHold is the slots one task holds, and the context its handler runs
// in, which ends if it loses one of them.
type slotHold struct {
	s      *Scheduler
	holder string
	ctx    context.Context
	cancel context.CancelCauseFunc
	stop   chan struct{} // closed when the task gives its slots back
	wg     sync.WaitGroup

	mu    sync.Mutex
	taken []heldSlot
}

// heldSlot is a slot taken, and the instant (our clock) by which the task
// stops unless a renew reaches Redis first.
type heldSlot struct {
	slot
	until time.Time
}

// stopMargin is how long before its lease could end a task whose renews do
// not reach Redis is stopped (5s of the 30s lease): its handler has that
// long to return before another task may take the slot. The lease is
// counted from when the call that set it was sent, which is no later than
// Redis set it.
func stopMargin(lease time.Duration) time.Duration { return lease / 6 }

// takeSlots takes the task's concurrency slots (its queue's and its
// type's), waiting up to HoldMax for them; slots taken are renewed from
// then on, also while the task waits for the next. It returns nil and how
// soon to ask again if the task must go back to Redis: a slot is not free,
// or Redis failed and the slot's policy is wait.
func (s *Scheduler) takeSlots(ctx context.Context, gs *gateSet, task taskRef) (*slotHold, time.Duration) {
	t, queue, id := task.t, task.queue, task.id
	if !gs.routeOf(queue, t.Type()).slots {
		return &slotHold{ctx: ctx}, 0 // nothing to take, renew or release
	}
	h := &slotHold{s: s, holder: slotHolder(s.worker, queue, id), stop: make(chan struct{})}
	h.ctx, h.cancel = context.WithCancelCause(ctx)
	deadline := s.clock.Now().Add(gs.cfg.Worker.HoldMax)
	vars := varsOf(queue, id, t)
	for _, sl := range s.semaphoresOf(gs, queue, t.Type(), vars) {
		for {
			sent := s.clock.Now()
			st, err := sl.sem.Acquire(ctx, sl.key, h.holder)
			if err != nil {
				if s.slotUnavailable(ctx, sl, h.holder, err) == OnRedisErrorAllow {
					break // the task runs without this slot
				}
				h.release()
				return nil, redisRetry
			}
			if st.Held {
				h.add(sl, sent)
				break
			}
			if s.clock.Now().After(deadline) || h.ctx.Err() != nil {
				h.release()
				return nil, min(max(st.Free, 50*time.Millisecond), time.Second)
			}
			select {
			case <-h.ctx.Done(): // a slot taken was lost, or the worker stops
			case <-s.clock.After(50 * time.Millisecond):
			}
		}
	}
	return h, 0
}

// slotHolder names a task in the semaphores: its worker, its queue and its
// ID, since asynq IDs are unique per queue only. The queue is escaped in
// braces (throttle.Key), which it cannot contain once escaped, so no queue
// and ID can pass for another pair ("a:b" + "c" and "a" + "b:c" differ).
func slotHolder(worker, queue, id string) string {
	return worker + ":" + throttle.Key("", queue) + ":" + id
}

// slotUnavailable gives back the slot a failed Acquire may have taken,
// counts and logs the failure, and returns the slot's policy (wait if the
// task's context ended: the worker stops, and Redis did not fail).
func (s *Scheduler) slotUnavailable(ctx context.Context, sl slot, holder string, err error) string {
	var answered redis.Error
	if !errors.As(err, &answered) {
		// No reply: the Acquire may have run and taken the slot, for a
		// lease nobody would renew or release. Release is harmless if it
		// did not; if Redis cannot be reached for it either, the lease ends.
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
		_ = sl.sem.Release(rctx, sl.key, holder)
		cancel()
	}
	if ctx.Err() != nil {
		return OnRedisErrorWait
	}
	s.metrics.redisErrors.WithLabelValues(sl.gate()).Inc()
	s.metrics.fallbacks.WithLabelValues(sl.gate(), sl.policy).Inc()
	if d, _ := s.logGate.AllowN(context.Background(), sl.gate(), 1); d.Allowed {
		s.log.Warn("a concurrency limit cannot reach redis (further failures in the next 10s are only counted)", "slot", sl.label, "policy", sl.policy, "err", err)
	}
	return sl.policy
}

// add notes a slot taken by a call sent at sent, and starts renewing with
// the first.
func (h *slotHold) add(sl slot, sent time.Time) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.taken = append(h.taken, heldSlot{sl, h.until(sent)})
	if len(h.taken) == 1 {
		h.wg.Go(h.renew)
	}
}

// until is when a task whose lease was set by a call sent at sent stops,
// unless a renew reaches Redis first.
func (h *slotHold) until(sent time.Time) time.Time {
	return sent.Add(h.s.slotLease - stopMargin(h.s.slotLease))
}

// renew renews the leases of the slots taken every third of a lease, and
// after a failed renew every tenth, until the task gives them back or
// loses one.
func (h *slotHold) renew() {
	lease := h.s.slotLease
	ctx := context.WithoutCancel(h.ctx) // renew until release, also while the worker stops
	wait := lease / 3
	for {
		h.mu.Lock()
		taken := append([]heldSlot(nil), h.taken...)
		h.mu.Unlock()
		first := taken[0].until
		for _, sl := range taken {
			if sl.until.Before(first) {
				first = sl.until
			}
		}
		select {
		case <-h.stop:
			return
		case <-h.s.clock.After(min(wait, first.Sub(h.s.clock.Now()))):
		}
		wait = lease / 3
		for i, sl := range taken {
			if !h.s.clock.Now().Before(sl.until) {
				h.lose(sl.slot, "stopped", errors.New("no renew reached redis in time"))
				return
			}
			sent := h.s.clock.Now()
			rctx, cancel := context.WithTimeout(ctx, lease/10)
			st, err := sl.sem.Renew(rctx, sl.key, h.holder)
			cancel()
			switch {
			case err != nil:
				wait = lease / 10
				if d, _ := h.s.logGate.AllowN(context.Background(), "renew:"+sl.label, 1); d.Allowed {
					h.s.log.Warn("cannot renew a concurrency lease; trying again (further failures in the next 10s are not logged)", "slot", sl.label, "stop in", sl.until.Sub(h.s.clock.Now()), "err", err)
				}
				continue
			case !st.Held:
				h.lose(sl.slot, "stopped", errors.New("redis says its lease ended and another task has the slot"))
				return
			case st.Lapsed:
				h.lose(sl.slot, "retaken", errors.New("redis says its lease ended; a free slot was taken again"))
			}
			h.mu.Lock()
			h.taken[i].until = h.until(sent)
			h.mu.Unlock()
		}
	}
}

// lose counts a slot lost and, unless the task took a slot again (result
// retaken), stops the task.
func (h *slotHold) lose(sl slot, result string, why error) {
	h.s.metrics.slotsLost.WithLabelValues(sl.label, result).Inc()
	h.s.log.Warn("a running task lost its concurrency slot", "slot", sl.label, "holder", h.holder, "result", result, "why", why)
	if result == "stopped" {
		h.cancel(errSlotLost)
	}
}

// release gives the slots back and reports whether the task was stopped
// for losing one.
func (h *slotHold) release() (lost bool) {
	if h.cancel == nil {
		return false // the task takes no slot
	}
	close(h.stop)
	h.wg.Wait()
	lost = context.Cause(h.ctx) == errSlotLost
	h.cancel(nil)
	for _, sl := range h.taken {
		if err := sl.sem.Release(context.WithoutCancel(h.ctx), sl.key, h.holder); err != nil {
			h.s.log.Warn("cannot release a concurrency slot; its lease will end", "slot", sl.label, "err", err)
		}
	}
	return lost
}
