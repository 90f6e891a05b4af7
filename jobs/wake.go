package jobs

import (
	"context"
	"strconv"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/lua"
)

// A task that waits in Redis is scheduled in asynq for a second after it is
// due, and noted in its queue's wake set with the µs it is due at. asynq
// schedules in whole seconds: a task scheduled for 12:00:00.900 becomes
// pending just after 12:00:00.000, 900ms early, and a worker would have to
// hold it (taking a slot) or send it round again. Instead one worker of the
// fleet at a time, the queue's waker, takes the tasks due from the wake set
// and moves them to the head of pending (ready: lua/ready.lua; asynq's
// Inspector.RunTask would put them behind the backlog) on time; the others
// only ask now and then whether its lease has lapsed. If no worker does,
// asynq's own forwarder still brings them, a little late, and they book
// again.
const (
	wakeBatch = 100 // tasks one look moves at most
	// wakeEvery: the waker looks this often, and each look takes the tasks
	// due before the next one too: they come back up to wakeEvery early,
	// and wait the rest in the worker (see hold). A look costs a script run
	// of 5 or 6 commands however many tasks it takes: looking when each
	// task comes would cost that per task.
	wakeEvery  = 100 * time.Millisecond
	fairLook   = 20 * time.Millisecond  // how often a waker lets tasks out of fair lines
	wakeLease  = time.Second            // a waker that dies is replaced this soon
	wakeWatch  = 250 * time.Millisecond // how often the other workers ask whether the waker resigned
	wakeLatest = time.Second            // how much later than due asynq brings a task back by itself
	// A task due that asynq still has as running is looked at again
	// wakeAgain later, for up to wakeStillActive after it was due: it is
	// on its way to the retry list.
	wakeAgain       = 20 * time.Millisecond
	wakeStillActive = time.Second
)

var (
	wakeScript  = redis.NewScript(lua.Wake)
	readyScript = redis.NewScript(lua.Ready)
)

// waker brings back the tasks that wait in Redis when they are due: in
// every queue of the config in force whose waker this worker is, it takes
// them from the wake set and moves them to the head of pending (run); it
// is told of tasks noted due sooner than its next look (note).
type waker struct {
	fleetDeps
	metrics *Metrics

	wakerOf sync.Map      // queue -> time.Time: this worker's next look at the queue's wake set, while it is its waker
	lookNow chan struct{} // a task was noted due before the next look
}

func newWaker(deps fleetDeps, m *Metrics) *waker {
	return &waker{fleetDeps: deps, metrics: m, lookNow: make(chan struct{}, 1)}
}

// note notes that task id of queue is due back in wait (at, on the
// limiters' clock, if not zero: then the script needs no TIME), and tells
// the waker if it would otherwise look too late.
func (w *waker) note(ctx context.Context, queue, id string, wait time.Duration, at time.Time) error {
	due := strconv.FormatInt(wait.Microseconds(), 10)
	if !at.IsZero() {
		due = "@" + strconv.FormatInt(at.UnixMicro(), 10)
	}
	err := wakeScript.Run(ctx, w.rdb, wakeKeys(queue), w.clock.scriptNow(), "note", id, due).Err()
	if err == nil {
		w.lookSooner(queue, wait)
	}
	return err
}

// lookSooner tells the waker of a task of queue noted due in wait, if it
// would otherwise look too late for it.
func (w *waker) lookSooner(queue string, wait time.Duration) {
	if next, ok := w.wakerOf.Load(queue); ok && w.clock.Now().Add(wait).Before(next.(time.Time)) {
		select {
		case w.lookNow <- struct{}{}:
		default:
		}
	}
}

// run moves the tasks due back to pending, in every queue whose waker
// this worker is, until ctx ends; then it resigns.
func (w *waker) run(ctx context.Context) {
	for {
		idle, waker := wakeLease, map[string]bool{}
		for queue := range w.gates().cfg.Queues {
			d, ok := w.wakeQueue(ctx, queue)
			idle, waker[queue] = min(idle, d), ok
		}
		next := w.clock.Now().Add(idle)
		for queue, ok := range waker {
			if ok {
				w.wakerOf.Store(queue, next)
			} else {
				w.wakerOf.Delete(queue)
			}
		}
		select {
		case <-ctx.Done():
			stop, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
			defer cancel()
			for queue := range w.gates().cfg.Queues {
				_ = wakeScript.Run(stop, w.rdb, wakeKeys(queue), w.clock.scriptNow(), "resign", w.worker).Err()
			}
			return
		case <-w.lookNow:
		case <-w.clock.After(idle):
		}
	}
}

// wakeQueue moves queue's tasks that are due (or nearly) to pending, if
// this worker is its waker, and returns how soon to look again and whether
// it is the waker.
func (w *waker) wakeQueue(ctx context.Context, queue string) (time.Duration, bool) {
	keys, args := wakeKeys(queue), []any{w.clock.scriptNow(), "take", wakeBatch, wakeEvery.Microseconds(), w.worker, wakeLease.Microseconds()}
	if f := w.gates().fair[queue]; f != nil {
		more, extra := f.wakeArgs()
		keys, args = append(keys, more...), append(args, extra...)
	}
	reply, err := wakeScript.Run(ctx, w.rdb, keys, args...).Slice()
	if err != nil || len(reply) == 0 {
		return wakeEvery, false
	}
	lines, _ := reply[0].(int64)
	if lines == -2 && len(reply) == 2 {
		// Another worker is the waker: look again when its lease ends, or
		// sooner in case it resigns.
		until, _ := reply[1].(int64)
		return min(time.Duration(until)*time.Microsecond+time.Millisecond, wakeWatch), false
	}
	if err := w.ready(ctx, queue, reply[1:]); err != nil {
		w.log.Warn("cannot move tasks due back to their queue; asynq brings them a second late", "queue", queue, "err", err)
	}
	switch {
	case (len(reply)-1)/2 >= wakeBatch:
		return 0, true // more may be due
	case lines == 1:
		// Tasks wait in fair lines, on shares, not on time: look again
		// soon.
		return fairLook, true
	}
	return wakeEvery, true
}

// rebook brings forward the tasks waiting in Redis for turns booked under
// a limit that has changed: they were scheduled at the old rate. Back in a
// worker, they book new turns at the new rate. One worker of the fleet does
// it for each change.
func (w *waker) rebook(ctx context.Context, gs *gateSet, stale []string) {
	claim := rebookClaim(stale)
	if ok, err := w.rdb.SetNX(ctx, claim, w.worker, time.Minute).Result(); err != nil || !ok {
		return
	}
	moved := 0
	for queue := range gs.cfg.Queues {
		// Every task that waits in Redis for a turn is in its queue's wake
		// set; a changed quota may be any type's, in any queue.
		n, err := wakeScript.Run(ctx, w.rdb, wakeKeys(queue), w.clock.scriptNow(), "rush").Int()
		if err != nil {
			w.log.Warn("cannot bring forward tasks booked at an old rate", "queue", queue, "err", err)
			continue
		}
		moved += n
	}
	w.log.Info("limits changed: tasks booked at the old rate book again", "gates", stale, "tasks", moved)
}

// ready moves the tasks taken from the wake set (id, µs since due, ...) to
// the head of their queue, in one call: a task back for its turn is taken
// before the queue's backlog. A task that asynq still lists as running was
// noted just before asynq moved it to its retry list: it is looked at again
// in a moment, for up to a second after it was due.
func (w *waker) ready(ctx context.Context, queue string, taken []any) error {
	if len(taken) == 0 {
		return nil
	}
	prefix := asynqKeys(queue)
	args := []any{prefix + "t:", w.clock.Now().UnixNano()}
	for i := 0; i+1 < len(taken); i += 2 {
		args = append(args, taken[i])
	}
	moved, err := readyScript.Run(ctx, w.queues, []string{prefix + "pending", prefix + "retry", prefix + "scheduled"}, args...).Int64Slice()
	if err != nil {
		return err
	}
	for i, result := range moved {
		id, _ := taken[2*i].(string)
		overdue, _ := taken[2*i+1].(int64)
		switch {
		case result == 1:
			w.metrics.woken.Inc()
		case result == 2 && overdue < wakeStillActive.Microseconds():
			_ = w.note(ctx, queue, id, wakeAgain, time.Time{})
		}
		// Otherwise gone (it ran, was deleted), pending already, or
		// archived: nothing to do.
	}
	return nil
}
