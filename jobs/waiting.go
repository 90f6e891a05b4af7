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
	held           holdResult = iota // the turn came (or the worker stops: see ctx)
	toRedis                          // the task should wait in Redis instead
	limitsChanged                    // its gates' limits changed: its turn is void
	keyRateChanged                   // a key value's learned limit it booked on changed: its turn is void
)

// hold waits in this worker for wait, taking none of its slots that run
// handlers, if the queue may hold one more task here (at most half of
// worker.waiting, so that a slow queue cannot keep the others' tasks out);
// else the task should rather go back to Redis. A turn closer than
// alwaysHold is always waited for. A task with no retry left waits here up
// to worker.reserve_max, as long as its deadline allows: in Redis it would
// have to be a copy, and its id and Unique lock would be free meanwhile.
// A config with other limits ends the wait: the task books again.
func (s *Scheduler) hold(ctx context.Context, gs *gateSet, task taskRef, wait time.Duration, claims []claim) holdResult {
	if wait > holdLongest(ctx, gs, task) && wait > alwaysHold {
		return toRedis
	}
	queue := task.queue
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
		return limitsChanged // the task gives its turns back (giveBackStale)
	case <-supersededOf(claims):
		gs.held.leave(gs.replaced)
		return keyRateChanged
	}
	gs.held.leave(gs.replaced)
	return held
}

// supersededOf is the channel closed when the learned limit of a key
// value that claims book on changes (nil: none is learned). A task draws
// on at most one keyed adaptive quota in practice; of several, the first
// one's counts.
func supersededOf(claims []claim) <-chan struct{} {
	for _, c := range claims {
		if c.g.superseded != nil {
			return c.g.superseded
		}
	}
	return nil
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

// giveBackStale gives back the turns tk holds, booked under gs's limits,
// which a config with other limits replaced while the task held them, and
// waits until the others held here with it have given theirs back too.
func (s *Scheduler) giveBackStale(ctx context.Context, gs *gateSet, tk *taken) {
	tk.giveBackTurns()
	gs.held.leave(gs.replaced)
	select {
	case <-gs.held.allBack:
	case <-s.clock.After(staleGiveBackWait):
	case <-ctx.Done():
	}
}

// holdsUpTo is the longest wait task would hold for in this
// worker now (see hold); one that must wait longer goes back to Redis.
func (b *booker) holdsUpTo(ctx context.Context, gs *gateSet, task taskRef) time.Duration {
	if b.holdingOf(task.queue).Load() >= holdRoom(gs) {
		return alwaysHold
	}
	return max(holdLongest(ctx, gs, task), alwaysHold)
}

// holdLongest is how long a task may wait in the worker, room allowing:
// worker.hold_max, or worker.reserve_max for a task with no retry left, as
// long as its deadline allows.
func holdLongest(ctx context.Context, gs *gateSet, task taskRef) time.Duration {
	longest := gs.cfg.Worker.HoldMax
	if task.exhausted {
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

func (b *booker) holdingOf(queue string) *atomic.Int64 {
	v, _ := b.holding.LoadOrStore(queue, new(atomic.Int64))
	return v.(*atomic.Int64)
}

// redisWait is how a task waits in Redis: askAgainIn (due back in d),
// dueBack (for turns kept under its booking ID) or waitInLine (in its
// key's line, until the waker lets it out).
type redisWait interface{ redisWait() }

// dueBack: the task is due back at at, on the limiters' clock (in d on
// ours), for the turns it keeps under its booking ID; it is noted without
// asking Redis for the time.
type dueBack struct {
	d  time.Duration
	at time.Time
}

func (askAgainIn) redisWait() {}
func (dueBack) redisWait()    {}
func (waitInLine) redisWait() {}

// waitInRedis sends a task that must wait back to Redis, as w says (its
// turns, if it holds any, stay kept under its booking ID in the
// limiters), and notes when it is due in its queue's wake set. A task with
// a retry left goes through asynq's retry path: the same task, so its id
// and Unique lock stay taken while it waits. A task with none left would be
// archived on that path; it goes back as a copy instead (copyForLater).
// Either way it is never failed, retried or archived for waiting. w is
// askAgainIn or dueBack; a task bound for its key's line goes by
// waitInLine.
func (s *Scheduler) waitInRedis(ctx context.Context, task taskRef, w redisWait) error {
	_, err := s.waitIn(ctx, task, w)
	return err
}

// waitNoted is waitInRedis for a task that its booking noted in the wake
// set already (throttle.Remind), due back in wait: it has a retry left.
func (s *Scheduler) waitNoted(queue string, wait time.Duration) error {
	s.waker.lookSooner(queue, wait)
	s.metrics.throttled.WithLabelValues(queue, "requeued").Inc()
	return &waitError{wait: wait}
}

// waitInLine is waitInRedis for a task whose key holds its fair share:
// it waits in its key's line until the queue's waker lets it out. letOut:
// the waker let it out already (see lineSpot.seen), and it books.
func (s *Scheduler) waitInLine(ctx context.Context, task taskRef, spot *lineSpot) (letOut bool, err error) {
	return s.waitIn(ctx, task, waitInLine{spot})
}

func (s *Scheduler) waitIn(ctx context.Context, task taskRef, w redisWait) (letOut bool, err error) {
	if !task.exhausted {
		wait, letOut := s.note(ctx, task.queue, task.id, w)
		if letOut {
			return true, nil
		}
		s.metrics.throttled.WithLabelValues(task.queue, "requeued").Inc()
		return false, &waitError{wait: wait}
	}
	if letOut, err = s.requeue(ctx, task, w); !letOut {
		s.metrics.throttled.WithLabelValues(task.queue, "requeued").Inc()
	}
	return letOut, err
}

// note notes task id of queue as w says: in the wake set, due back in d
// (at, on the limiters' clock, for dueBack), or in its key's line; it
// returns when asynq should bring it back by itself if nobody does (less
// wakeLatest). letOut: the task was let out of its line, and books.
func (s *Scheduler) note(ctx context.Context, queue, id string, w redisWait) (wait time.Duration, letOut bool) {
	var at time.Time
	switch w := w.(type) {
	case waitInLine:
		est, letOut, err := s.park(ctx, queue, id, w.spot)
		if letOut {
			return 0, true
		}
		return s.inLine(queue, id, est, err), false
	case dueBack:
		wait, at = w.d, w.at
	case askAgainIn:
		wait = w.d
	}
	if err := s.waker.note(ctx, queue, id, wait, at); err != nil {
		s.log.Warn("cannot note when a waiting task is due; asynq brings it back a second late", "queue", queue, "id", id, "err", err)
	}
	return wait, false
}

// inLine is how long task id in its key's line (est, from park or
// lineWait) waits for asynq's own schedule: the waker lets it out as its
// key's share allows, and asynq's schedule is the fallback, well after the
// estimate.
func (s *Scheduler) inLine(queue, id string, est time.Duration, err error) time.Duration {
	if err != nil {
		s.log.Warn("cannot put a task in its key's line; it asks again in a second", "queue", queue, "id", id, "err", err)
		return redisRetry
	}
	return 2*est + parkedFallback
}

// requeue sends a copy of the task back to Redis, waiting as w says, and
// revokes this one: asynq then deletes it without counting a failure or a
// retry. letOut: the task was let out of its key's line, and books.
//
// While Redis cannot take the copy (restarting, loading its data, failing
// over), requeue tries again, backing off to once a second, for as long as
// the task's context lasts: the task is in no one else's hands meanwhile,
// and an error would cost it a retry; asynq archives a task that errs with
// none left, failure or not. The copy's id is fixed, so an attempt that
// reached Redis unanswered makes the next one a harmless duplicate.
func (s *Scheduler) requeue(ctx context.Context, task taskRef, w redisWait) (letOut bool, err error) {
	queue, id := task.queue, task.id
	giveUp := func(err error, attempts int) error {
		s.log.Warn("cannot requeue a task that must wait; asynq will retry it", "queue", queue, "id", id, "attempts", attempts, "err", err)
		return fmt.Errorf("%w: %v", errWaitInRedis, err)
	}
	backoff := 50 * time.Millisecond
	for attempt := 1; ; attempt++ {
		_, letOut, err := s.copyForLater(ctx, task, w)
		if letOut {
			return true, nil
		}
		if err == nil {
			if attempt > 1 {
				s.log.Info("requeued a task that must wait", "queue", queue, "id", id, "attempts", attempt)
			}
			return false, asynq.RevokeTask
		}
		if errors.Is(err, asynq.ErrTaskNotFound) || errors.Is(err, asynq.ErrQueueNotFound) {
			return false, giveUp(err, attempt) // Redis answered: no attempt will find it
		}
		if attempt == 1 {
			s.log.Warn("cannot requeue a task that must wait; trying again", "queue", queue, "id", id, "err", err)
		}
		select {
		case <-ctx.Done():
			return false, giveUp(err, attempt)
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
func (s *Scheduler) copyForLater(ctx context.Context, task taskRef, w redisWait) (copyID string, letOut bool, err error) {
	t, queue, id := task.t, task.queue, task.id
	info, err := s.inspector.GetTaskInfo(queue, id)
	if err != nil {
		return "", false, err
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
	idOf := func(try int) string {
		copyID := origin + "~" + strconv.Itoa(hop)
		if try > 1 {
			copyID += "~" + strconv.Itoa(try)
		}
		return copyID
	}
	var wait time.Duration
	switch mode := w.(type) {
	case askAgainIn:
		wait = mode.d
	case dueBack:
		wait = mode.d
	case waitInLine:
		// Its wait in its line, for asynq's schedule (the fallback after
		// the estimate). The copy goes in its line once made, under the id
		// it got: the line's ids are moved to pending as they are let out,
		// and an id taken by another task would move that task.
		est, letOut, err := s.lineWait(ctx, queue, mode.spot)
		if letOut {
			return "", true, nil
		}
		wait = s.inLine(queue, id, est, err)
		// Whether it was let out is asked now: once in the line, it
		// waits there.
		parked := *mode.spot
		parked.seen = false
		w = waitInLine{&parked}
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
		copyID := idOf(try)
		_, err := s.client.EnqueueContext(ctx, copied, append(opts, asynq.TaskID(copyID))...)
		if errors.Is(err, asynq.ErrTaskIDConflict) {
			if s.isCopy(queue, copyID, copied) {
				return copyID, false, nil // an earlier attempt, or an earlier run of this task, made it
			}
			continue
		}
		if err != nil {
			return "", false, err
		}
		s.note(ctx, queue, copyID, w)
		return copyID, false, nil
	}
	return "", false, fmt.Errorf("jobs: %d ids for the copy of task %s are taken by other tasks", maxCopyIDs, id)
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
func (s *Scheduler) upstreamBusy(ctx context.Context, gs *gateSet, task taskRef, busy *UpstreamBusyError) error {
	t, queue, id := task.t, task.queue, task.id
	if busy.Ignored != "" {
		s.log.Warn("upstream busy: its Retry-After is ignored", "type", t.Type(), "status", busy.Status, "why", busy.Ignored)
	}
	wait := busy.RetryAfter
	if wait <= 0 {
		wait = time.Second // no usable Retry-After: a short pause, then ask the quotas again
	}
	longest := time.Duration(0)
	cut := 0 // adaptive quotas, not blocked
	vars := varsOf(queue, id, t)
	for _, g := range gs.quotasOf(t.Type()) {
		block := wait
		if block > g.limit.MaxBlock {
			s.log.Warn("upstream busy: Retry-After longer than the quota's max_block; blocked for max_block", "quota", g.key, "retry_after", wait, "max_block", g.limit.MaxBlock)
			block = g.limit.MaxBlock
		}
		longest = max(longest, block)
		s.metrics.upstreamBusy.WithLabelValues(g.key).Inc()
		var c claim
		if g.expr != nil {
			c = s.claimOf(g, vars)
		}
		// An adaptive quota's rate (a keyed one's: the key value's, unless
		// an override sets it) is cut instead (adapt.go): a pause would end
		// in a burst.
		if g.limit.Adaptive != nil && block <= adaptiveBlockOver && !s.pinned(g.key) &&
			(g.expr == nil || g.overrides.of(c.key, false) == nil) {
			cut++
			continue
		}
		if g.expr != nil {
			s.blockKey(ctx, g, c, block)
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
	if cut < len(gs.quotasOf(t.Type())) {
		s.log.Info("upstream busy: quotas blocked", "type", t.Type(), "status", busy.Status, "for", longest)
	}
	return s.waitInRedis(ctx, task, askAgainIn{longest})
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
