package jobs

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hibiken/asynq"
)

// Task headers of a copy of a task that waits in Redis (see waitInRedis).
const (
	headerOrigin = "sluice-origin" // the id of the task as first enqueued
	headerHop    = "sluice-hop"    // how many times it went back to Redis as a copy
)

// errWaitInRedis is returned when a task that must wait could not be
// requeued before its context ended (Redis failed for that long): asynq then
// retries it without counting a failure, if it has a retry left.
var errWaitInRedis = errors.New("jobs: task must wait and could not be requeued")

// waitError sends a task back to Redis through asynq's retry path, to be
// back after wait: the same task, its id and Unique lock kept, its retries
// untouched (AsynqConfig's IsFailure does not count it).
type waitError struct{ wait time.Duration }

func (e *waitError) Error() string {
	return fmt.Sprintf("%s%v in Redis for its turn (not a failure)", waitErrorPrefix, e.wait.Round(time.Millisecond))
}

// waitErrorPrefix begins every waitError's text: asynq keeps it as the
// task's last error, and WaitingTask tells waiting from retries by it.
const waitErrorPrefix = "sluice: waiting "

// holdResult is how a wait in the worker ended.
type holdResult int

const (
	held          holdResult = iota // the turn came (or the worker stops: see ctx)
	toRedis                         // the task should wait in Redis instead
	limitsChanged                   // its gates' limits changed: its turn is void
)

// hold waits in this worker for wait, taking none of its slots that run
// handlers, if the queue may hold one more task here (at most half of
// worker.waiting, so that a slow queue cannot keep the others' tasks out);
// else the task should rather go back to Redis. A turn closer than
// alwaysHold is always waited for. A task with no retry left waits here up
// to worker.reserve_max, as long as its deadline allows: in Redis it would
// have to be a copy, and its id and Unique lock would be free meanwhile.
// A config with other limits ends the wait: the task books again.
func (s *Scheduler) hold(ctx context.Context, gs *gateSet, queue string, wait time.Duration) holdResult {
	if wait > holdLongest(ctx, gs) && wait > alwaysHold {
		return toRedis
	}
	holding := s.holdingOf(queue)
	if holding.Add(1) > holdRoom(gs) && wait > alwaysHold {
		holding.Add(-1)
		return toRedis
	}
	defer holding.Add(-1)
	s.metrics.throttled.WithLabelValues(queue, "held").Inc()
	s.metrics.waited.WithLabelValues(queue).Add(wait.Seconds())
	gs.held.enter()
	select {
	case <-ctx.Done():
	case <-s.clock.After(wait):
	case <-gs.replaced:
		return limitsChanged // the caller gives its turns back (giveBackStale)
	}
	gs.held.leave(gs.replaced)
	return held
}

// heldTurns counts the tasks that hold turns of one gate set in this
// worker, so that when a config with other limits replaces it they all
// give their turns back before any of them books again: a changed limit
// takes over what the old one counted when it is first used
// (throttle.Replacing), and a bucket's turns within its window could not
// be told from what was used.
type heldTurns struct {
	n       atomic.Int64
	once    sync.Once
	allBack chan struct{} // closed once the set is replaced and none holds
}

func newHeldTurns() *heldTurns { return &heldTurns{allBack: make(chan struct{})} }

func (h *heldTurns) enter() { h.n.Add(1) }

func (h *heldTurns) leave(replaced <-chan struct{}) {
	if h.n.Add(-1) > 0 {
		return
	}
	select {
	case <-replaced:
		h.once.Do(func() { close(h.allBack) })
	default:
	}
}

// staleGiveBackWait bounds how long a task whose turns were booked under
// replaced limits waits for the others held with it to give theirs back
// (a script call each, all at once).
const staleGiveBackWait = 250 * time.Millisecond

// giveBackStale gives back turns b booked under gs's limits, which a config
// with other limits replaced while the task held them, and waits until the
// others held here with it have given theirs back too.
func (s *Scheduler) giveBackStale(ctx context.Context, gs *gateSet, b booking) {
	s.giveBack(ctx, b)
	gs.held.leave(gs.replaced)
	select {
	case <-gs.held.allBack:
	case <-s.clock.After(staleGiveBackWait):
	case <-ctx.Done():
	}
}

// holdsUpTo is the longest wait a task of queue would hold for in this
// worker now (see hold); one that must wait longer goes back to Redis.
func (s *Scheduler) holdsUpTo(ctx context.Context, gs *gateSet, queue string) time.Duration {
	if s.holdingOf(queue).Load() >= holdRoom(gs) {
		return alwaysHold
	}
	return max(holdLongest(ctx, gs), alwaysHold)
}

// holdLongest is how long a task may wait in the worker, room allowing:
// worker.hold_max, or worker.reserve_max for a task with no retry left, as
// long as its deadline allows.
func holdLongest(ctx context.Context, gs *gateSet) time.Duration {
	longest := gs.cfg.Worker.HoldMax
	if exhausted(ctx) {
		longest = gs.cfg.Worker.ReserveMax
	}
	if deadline, ok := ctx.Deadline(); ok {
		longest = min(longest, time.Until(deadline)-time.Second)
	}
	return longest
}

// holdRoom is how many tasks of one queue a worker holds at most: half of
// worker.waiting.
func holdRoom(gs *gateSet) int64 { return int64(max(1, gs.cfg.Worker.Waiting/2)) }

func (s *Scheduler) holdingOf(queue string) *atomic.Int64 {
	v, _ := s.holding.LoadOrStore(queue, new(atomic.Int64))
	return v.(*atomic.Int64)
}

// exhausted reports whether the task has no retry left: asynq would archive
// it on the retry path.
func exhausted(ctx context.Context) bool {
	retried, _ := asynq.GetRetryCount(ctx)
	maxRetry, _ := asynq.GetMaxRetry(ctx)
	return retried >= maxRetry
}

// waitInRedis sends a task that must wait back to Redis, due back in wait
// (its turns, if it holds any, stay kept under its booking ID in the
// limiters), and notes when it is due in its queue's wake set. A task with
// a retry left goes through asynq's retry path: the same task, so its id
// and Unique lock stay taken while it waits. A task with none left would be
// archived on that path; it goes back as a copy instead (copyForLater).
// Either way it is never failed, retried or archived for waiting.
func (s *Scheduler) waitInRedis(ctx context.Context, t *asynq.Task, queue, id string, wait time.Duration) error {
	return s.waitIn(ctx, t, queue, id, wait, time.Time{}, nil)
}

// waitForTurn is waitInRedis for a task that just booked its turns: due
// back at on the limiters' clock (in wait on ours), noted without asking
// Redis for the time.
func (s *Scheduler) waitForTurn(ctx context.Context, t *asynq.Task, queue, id string, wait time.Duration, at time.Time) error {
	return s.waitIn(ctx, t, queue, id, wait, at, nil)
}

// waitNoted is waitInRedis for a task that its booking noted in the wake
// set already (throttle.Remind), due back in wait: it has a retry left.
func (s *Scheduler) waitNoted(queue string, wait time.Duration) error {
	s.waker.lookSooner(queue, wait)
	s.metrics.throttled.WithLabelValues(queue, "requeued").Inc()
	return &waitError{wait: wait}
}

// waitInLine is waitInRedis for a task whose key holds its fair share:
// it waits in its key's line until the queue's waker lets it out.
func (s *Scheduler) waitInLine(ctx context.Context, t *asynq.Task, queue, id string, line *lineSpot) error {
	return s.waitIn(ctx, t, queue, id, 0, time.Time{}, line)
}

func (s *Scheduler) waitIn(ctx context.Context, t *asynq.Task, queue, id string, wait time.Duration, at time.Time, line *lineSpot) error {
	if !exhausted(ctx) {
		wait, err := s.note(ctx, queue, id, wait, at, line)
		if err != nil {
			return err
		}
		s.metrics.throttled.WithLabelValues(queue, "requeued").Inc()
		return &waitError{wait: wait}
	}
	err := s.requeue(ctx, t, queue, id, wait, at, line)
	if !errors.Is(err, errLetOut) {
		s.metrics.throttled.WithLabelValues(queue, "requeued").Inc()
	}
	return err
}

// note notes task id of queue in the wake set, due back in wait (at, on
// the limiters' clock, if not zero), or in its key's line; it returns when
// asynq should bring it back by itself if nobody does (less wakeLatest).
// errLetOut: the task books instead.
func (s *Scheduler) note(ctx context.Context, queue, id string, wait time.Duration, at time.Time, line *lineSpot) (time.Duration, error) {
	if line == nil {
		if err := s.waker.note(ctx, queue, id, wait, at); err != nil {
			s.log.Warn("cannot note when a waiting task is due; asynq brings it back a second late", "queue", queue, "id", id, "err", err)
		}
		return wait, nil
	}
	est, err := s.park(ctx, queue, id, line)
	return s.inLine(queue, id, est, err)
}

// inLine is how long task id in its key's line (est, from park or
// lineWait) waits for asynq's own schedule: the waker lets it out as its
// key's share allows, and asynq's schedule is the fallback, well after the
// estimate. errLetOut: the task books instead.
func (s *Scheduler) inLine(queue, id string, est time.Duration, err error) (time.Duration, error) {
	if errors.Is(err, errLetOut) {
		return 0, err
	}
	if err != nil {
		s.log.Warn("cannot put a task in its key's line; it asks again in a second", "queue", queue, "id", id, "err", err)
		return redisRetry, nil
	}
	return 2*est + parkedFallback, nil
}

// requeue sends a copy of the task back to Redis, due in wait, and revokes
// this one: asynq then deletes it without counting a failure or a retry.
//
// While Redis cannot take the copy (restarting, loading its data, failing
// over), requeue tries again, backing off to once a second, for as long as
// the task's context lasts: the task is in no one else's hands meanwhile,
// and an error would cost it a retry; asynq archives a task that errs with
// none left, failure or not. The copy's id is fixed, so an attempt that
// reached Redis unanswered makes the next one a harmless duplicate.
func (s *Scheduler) requeue(ctx context.Context, t *asynq.Task, queue, id string, wait time.Duration, at time.Time, line *lineSpot) error {
	giveUp := func(err error, attempts int) error {
		s.log.Warn("cannot requeue a task that must wait; asynq will retry it", "queue", queue, "id", id, "attempts", attempts, "err", err)
		return fmt.Errorf("%w: %v", errWaitInRedis, err)
	}
	backoff := 50 * time.Millisecond
	for attempt := 1; ; attempt++ {
		err := s.copyForLater(ctx, t, queue, id, wait, at, line)
		if errors.Is(err, errLetOut) {
			return err
		}
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

// maxCopyIDs bounds the ids copyForLater tries for one copy.
const maxCopyIDs = 8

// copyForLater enqueues the copy of task id that requeue sends back. Its id
// is <origin>~<hop>: fixed, so that if this task runs twice (its worker
// died after making the copy) the second copy is refused. An id taken is
// the copy already made only if that task is provably it (same type,
// payload, origin and hop); a producer may have chosen the id, and then the
// copy takes the next one (<origin>~<hop>~2, ...).
func (s *Scheduler) copyForLater(ctx context.Context, t *asynq.Task, queue, id string, wait time.Duration, at time.Time, line *lineSpot) error {
	info, err := s.inspector.GetTaskInfo(queue, id)
	if err != nil {
		return err
	}
	headers := maps.Clone(t.Headers())
	if headers == nil {
		headers = map[string]string{}
	}
	origin := headers[headerOrigin]
	if origin == "" {
		origin = id
	}
	hop, _ := strconv.Atoi(headers[headerHop])
	hop++
	headers[headerOrigin] = origin
	headers[headerHop] = strconv.Itoa(hop)
	copied := asynq.NewTaskWithHeaders(t.Type(), t.Payload(), headers)
	copyID := func(try int) string {
		copyID := origin + "~" + strconv.Itoa(hop)
		if try > 1 {
			copyID += "~" + strconv.Itoa(try)
		}
		return copyID
	}
	if line != nil {
		// Its wait in its line, for asynq's schedule (the fallback after
		// the estimate). The copy goes in its line once made, under the id
		// it got: the line's ids are moved to pending as they are let out,
		// and an id taken by another task would move that task.
		est, err := s.lineWait(ctx, queue, line)
		if wait, err = s.inLine(queue, id, est, err); err != nil {
			return err
		}
	}
	opts := []asynq.Option{
		asynq.Queue(queue),
		asynq.MaxRetry(max(0, info.MaxRetry-info.Retried)),
		// asynq's own schedule is the fallback: the wake set brings the copy
		// back on time (see wake.go).
		asynq.ProcessIn(wait + wakeLatest),
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
	for try := 1; try <= maxCopyIDs; try++ {
		copyID := copyID(try)
		_, err := s.client.EnqueueContext(ctx, copied, append(opts, asynq.TaskID(copyID))...)
		if errors.Is(err, asynq.ErrTaskIDConflict) {
			if s.isCopy(queue, copyID, copied) {
				return nil // an earlier attempt, or an earlier run of this task, made it
			}
			continue
		}
		if err != nil {
			return err
		}
		if line != nil {
			// Whether it was let out was asked by lineWait: in the line now,
			// it waits there.
			parked := *line
			line, parked.seen = &parked, false
		}
		_, _ = s.note(ctx, queue, copyID, wait, at, line)
		return nil
	}
	return fmt.Errorf("jobs: %d ids for the copy of task %s are taken by other tasks", maxCopyIDs, id)
}

// isCopy reports whether task id of queue is provably want: the same type,
// payload and sluice headers.
func (s *Scheduler) isCopy(queue, id string, want *asynq.Task) bool {
	info, err := s.inspector.GetTaskInfo(queue, id)
	if err != nil {
		return false
	}
	return info.Type == want.Type() && string(info.Payload) == string(want.Payload()) &&
		info.Headers[headerOrigin] == want.Headers()[headerOrigin] && info.Headers[headerHop] == want.Headers()[headerHop]
}

// upstreamBusy blocks every quota of the task's type until the upstream's
// Retry-After has passed, on every worker, and sends the task back to wait
// for it: an API that says "not now" has not failed the task.
func (s *Scheduler) upstreamBusy(ctx context.Context, gs *gateSet, queue, id string, t *asynq.Task, busy *UpstreamBusyError) error {
	if busy.Ignored != "" {
		s.log.Warn("upstream busy: its Retry-After is ignored", "type", t.Type(), "status", busy.Status, "why", busy.Ignored)
	}
	wait := busy.RetryAfter
	if wait <= 0 {
		wait = time.Second // no usable Retry-After: a short pause, then ask the quotas again
	}
	longest := time.Duration(0)
	vars := varsOf(queue, id, t)
	for _, g := range gs.quotasOf(t.Type()) {
		block := wait
		if block > g.limit.MaxBlock {
			s.log.Warn("upstream busy: Retry-After longer than the quota's max_block; blocked for max_block", "quota", g.key, "retry_after", wait, "max_block", g.limit.MaxBlock)
			block = g.limit.MaxBlock
		}
		longest = max(longest, block)
		s.metrics.upstreamBusy.WithLabelValues(g.key).Inc()
		if g.expr != nil {
			s.blockKey(ctx, g, s.claimOf(g, vars), block)
			continue
		}
		s.board.block(g.key, s.clock.Now().Add(block))
		if err := g.lim.Block(ctx, g.key, block); err != nil {
			s.log.Warn("cannot block a quota after an upstream said no", "quota", g.key, "err", err)
		}
		s.board.announce(ctx, g.key, block)
	}
	if len(gs.quotasOf(t.Type())) == 0 {
		longest = min(wait, defaultMaxBlock) // no quota to bound it: the default
	}
	s.log.Info("upstream busy: quotas blocked", "type", t.Type(), "status", busy.Status, "for", longest)
	return s.waitInRedis(ctx, t, queue, id, longest)
}

// WaitingTask reports whether a task asynq holds in its retry or scheduled
// set (info from asynq's Inspector) is waiting there for its turn, sent
// back by a worker (waitInRedis), rather than retried after a failure or
// scheduled by its producer: in the retry set, its last error is a wait's;
// in the scheduled set, it is a copy made for its turn (headerOrigin).
// asynqmon shows the former as retries all the same.
func WaitingTask(info *asynq.TaskInfo) bool {
	switch info.State {
	case asynq.TaskStateRetry:
		return strings.HasPrefix(info.LastErr, waitErrorPrefix) || strings.HasPrefix(info.LastErr, errWaitInRedis.Error())
	case asynq.TaskStateScheduled:
		return info.Headers[headerOrigin] != ""
	}
	return false
}

// blockKey blocks the task's key value c of keyed quota g for block, as
// upstreamBusy blocks an unkeyed quota: in Redis (no new turn), in this
// worker and, announced on blockChannel, in every other (turns booked
// before are not used either). The announcement names the value by its
// digest only (keyBlock).
func (s *Scheduler) blockKey(ctx context.Context, g *gate, c claim, block time.Duration) {
	kb := blockOfKey(g.key, c.key)
	now := s.clock.Now()
	s.board.keys.add(kb, now.Add(block), now)
	if err := c.lim.Block(ctx, c.key, block); err != nil {
		s.log.Warn("cannot block a quota's key after an upstream said no", "quota", g.key, "err", err)
	}
	s.board.announceKey(ctx, kb, block)
}
