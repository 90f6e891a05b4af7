package jobs

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/hibiken/asynq"
)

// errWaitInRedis is returned when a task that must wait could not be
// requeued before its context ended (Redis failed for that long): asynq then
// retries it without counting a failure, if it has a retry left.
var errWaitInRedis = errors.New("jobs: task must wait and could not be requeued")

// hold waits in this worker for wait, if the queue may hold one more of
// this worker's slots; it reports false when the task should rather go
// back to Redis. A turn closer than requeueLead is always waited for: going
// to Redis and back would take longer.
func (s *Scheduler) hold(ctx context.Context, gs *gateSet, queue string, wait time.Duration) bool {
	if wait > gs.cfg.Worker.HoldMax {
		return false
	}
	v, _ := s.holding.LoadOrStore(queue, new(atomic.Int64))
	holding := v.(*atomic.Int64)
	// A slow queue may hold at most half the slots, so that it cannot
	// starve the others on the same workers.
	limit := int64(max(1, gs.cfg.Worker.Concurrency/2))
	if holding.Add(1) > limit && wait > requeueLead {
		holding.Add(-1)
		return false
	}
	defer holding.Add(-1)
	s.metrics.throttled.WithLabelValues(queue, "held").Inc()
	s.metrics.waited.WithLabelValues(queue).Add(wait.Seconds())
	select {
	case <-ctx.Done():
	case <-s.clock.After(wait):
	}
	return true
}

// requeue sends a copy of the task back to Redis, scheduled for at and
// carrying its turns, and revokes this one: asynq then deletes it without
// counting a failure or a retry, whatever its MaxRetry.
//
// While Redis cannot take the copy (restarting, loading its data, failing
// over), requeue tries again, backing off to once a second, for as long as
// the task's context lasts: the task is in no one else's hands meanwhile,
// and an error would cost it a retry; asynq archives a task that errs with
// none left, failure or not. The copy's id is fixed, so an attempt that
// reached Redis unanswered makes the next one a harmless duplicate.
func (s *Scheduler) requeue(ctx context.Context, t *asynq.Task, queue string, at time.Time, turns []heldTurn) error {
	id, _ := asynq.GetTaskID(ctx)
	giveUp := func(err error, attempts int) error {
		s.log.Warn("cannot requeue a task that must wait; asynq will retry it", "queue", queue, "id", id, "attempts", attempts, "err", err)
		return fmt.Errorf("%w: %v", errWaitInRedis, err)
	}
	backoff := 50 * time.Millisecond
	for attempt := 1; ; attempt++ {
		err := s.copyForLater(ctx, t, queue, id, at, turns)
		if err == nil {
			if attempt > 1 {
				s.log.Info("requeued a task that must wait", "queue", queue, "id", id, "attempts", attempt)
			}
			return asynq.RevokeTask
		}
		if errors.Is(err, asynq.ErrTaskNotFound) || errors.Is(err, asynq.ErrQueueNotFound) {
			return giveUp(err, attempt) // Redis answered: no attempt will find it
		}
		if attempt == 1 {
			s.log.Warn("cannot requeue a task that must wait; trying again", "queue", queue, "id", id, "err", err)
		}
		select {
		case <-ctx.Done():
			return giveUp(err, attempt)
		case <-s.clock.After(backoff):
		}
		backoff = min(2*backoff, time.Second)
	}
}

// copyForLater enqueues the copy of task id that requeue sends back.
func (s *Scheduler) copyForLater(ctx context.Context, t *asynq.Task, queue, id string, at time.Time, turns []heldTurn) error {
	info, err := s.inspector.GetTaskInfo(queue, id)
	if err != nil {
		return err
	}
	headers := make(map[string]string, len(t.Headers())+3)
	for k, v := range t.Headers() {
		headers[k] = v
	}
	origin := headers[headerOrigin]
	if origin == "" {
		origin = id
	}
	hop, _ := strconv.Atoi(headers[headerHop])
	hop++
	headers[headerOrigin] = origin
	headers[headerHop] = strconv.Itoa(hop)
	delete(headers, headerTurns)
	if len(turns) > 0 {
		headers[headerTurns] = writeTurns(turns)
	}
	opts := []asynq.Option{
		asynq.Queue(queue),
		// A deterministic id: if this task runs twice (a worker died after
		// the copy was made), the second copy is refused as a duplicate.
		asynq.TaskID(origin + "~" + strconv.Itoa(hop)),
		asynq.MaxRetry(max(0, info.MaxRetry-info.Retried)),
		// asynq's own schedule is the fallback: the wake set brings the copy
		// back at at exactly (see wake.go).
		asynq.ProcessAt(at.Add(wakeLatest)),
	}
	if info.Timeout > 0 {
		opts = append(opts, asynq.Timeout(info.Timeout))
	}
	if !info.Deadline.IsZero() {
		opts = append(opts, asynq.Deadline(info.Deadline))
	}
	if info.Retention > 0 {
		opts = append(opts, asynq.Retention(info.Retention))
	}
	copied, err := s.client.EnqueueContext(ctx, asynq.NewTaskWithHeaders(t.Type(), t.Payload(), headers), opts...)
	if errors.Is(err, asynq.ErrTaskIDConflict) {
		return nil // an earlier attempt, or an earlier run of this task, made it
	}
	if err != nil {
		return err
	}
	if err := s.noteWake(ctx, queue, copied.ID, at); err != nil {
		s.log.Warn("cannot note when a waiting task is due; asynq brings it back a second late", "queue", queue, "id", copied.ID, "err", err)
	}
	return nil
}

// upstreamBusy blocks every quota of the task's type until the upstream's
// Retry-After has passed, on every worker, and sends the task back to wait
// for it: an API that says "not now" has not failed the task.
func (s *Scheduler) upstreamBusy(ctx context.Context, gs *gateSet, queue string, t *asynq.Task, busy *UpstreamBusyError) error {
	wait := busy.RetryAfter
	if wait <= 0 {
		wait = time.Second // no Retry-After: a short pause, then ask the quotas again
	}
	for _, g := range gs.quotasOf(t.Type()) {
		s.metrics.upstreamBusy.WithLabelValues(g.key).Inc()
		s.block(g.key, s.clock.Now().Add(wait))
		if err := g.lim.Block(ctx, g.key, wait); err != nil {
			s.log.Warn("cannot block a quota after an upstream said no", "quota", g.key, "err", err)
		}
		if err := s.rdb.Publish(ctx, blockChannel, g.key+" "+strconv.FormatInt(wait.Microseconds(), 10)).Err(); err != nil {
			s.log.Warn("cannot tell the fleet of a blocked quota", "quota", g.key, "err", err)
		}
	}
	s.log.Info("upstream busy: quotas blocked", "type", t.Type(), "status", busy.Status, "for", wait)
	return s.requeue(ctx, t, queue, s.clock.Now().Add(wait), nil)
}
