package jobs

import (
	"context"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/lua"
	"github.com/sluicehq/sluice/throttle"
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

func wakeKeys(queue string) []string {
	return []string{throttle.Key("sluice:wake:", queue), throttle.Key("sluice:waker:", queue)}
}

// noteWake notes that task id of queue is due back in wait (at, on the
// limiters' clock, if not zero: then the script needs no TIME), and tells
// this worker's waker if it would otherwise look too late.
func (s *Scheduler) noteWake(ctx context.Context, queue, id string, wait time.Duration, at time.Time) error {
	due := strconv.FormatInt(wait.Microseconds(), 10)
	if !at.IsZero() {
		due = "@" + strconv.FormatInt(at.UnixMicro(), 10)
	}
	err := wakeScript.Run(ctx, s.rdb, wakeKeys(queue), s.scriptNow(), "note", id, due).Err()
	if err == nil {
		s.lookSooner(queue, wait)
	}
	return err
}

// lookSooner tells this worker's waker of a task of queue noted due in
// wait, if it would otherwise look too late for it.
func (s *Scheduler) lookSooner(queue string, wait time.Duration) {
	if next, ok := s.wakerOf.Load(queue); ok && s.clock.Now().Add(wait).Before(next.(time.Time)) {
		select {
		case s.lookNow <- struct{}{}:
		default:
		}
	}
}

// scriptNow is the clock a script reads: Redis's own, or the injected one.
func (s *Scheduler) scriptNow() string {
	if s.injected {
		return strconv.FormatInt(s.clock.Now().UnixMicro(), 10)
	}
	return ""
}

// wake moves the tasks due back to pending, in every queue whose waker
// this worker is, until ctx ends; then it resigns.
func (s *Scheduler) wake(ctx context.Context) {
	for {
		idle, waker := wakeLease, map[string]bool{}
		for queue := range s.Config().Queues {
			d, ok := s.wakeQueue(ctx, queue)
			idle, waker[queue] = min(idle, d), ok
		}
		next := s.clock.Now().Add(idle)
		for queue, ok := range waker {
			if ok {
				s.wakerOf.Store(queue, next)
			} else {
				s.wakerOf.Delete(queue)
			}
		}
		select {
		case <-ctx.Done():
			stop, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
			defer cancel()
			for queue := range s.Config().Queues {
				_ = wakeScript.Run(stop, s.rdb, wakeKeys(queue), s.scriptNow(), "resign", s.worker).Err()
			}
			return
		case <-s.lookNow:
		case <-s.clock.After(idle):
		}
	}
}

// wakeQueue moves queue's tasks that are due (or nearly) to pending, if
// this worker is its waker, and returns how soon to look again and whether
// it is the waker.
func (s *Scheduler) wakeQueue(ctx context.Context, queue string) (time.Duration, bool) {
	keys, args := wakeKeys(queue), []any{s.scriptNow(), "take", wakeBatch, wakeEvery.Microseconds(), s.worker, wakeLease.Microseconds()}
	if f := s.gates.Load().fair[queue]; f != nil {
		more, extra := f.wakeArgs()
		keys, args = append(keys, more...), append(args, extra...)
	}
	reply, err := wakeScript.Run(ctx, s.rdb, keys, args...).Slice()
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
	if err := s.ready(ctx, queue, reply[1:]); err != nil {
		s.log.Warn("cannot move tasks due back to their queue; asynq brings them a second late", "queue", queue, "err", err)
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

// asynqKeys is the prefix of queue's keys in asynq v0.26's layout
// (internal/base), for what its API cannot do cheaply.
func asynqKeys(queue string) string { return "asynq:{" + queue + "}:" }

// ready moves the tasks taken from the wake set (id, µs since due, ...) to
// the head of their queue, in one call: a task back for its turn is taken
// before the queue's backlog. A task that asynq still lists as running was
// noted just before asynq moved it to its retry list: it is looked at again
// in a moment, for up to a second after it was due.
func (s *Scheduler) ready(ctx context.Context, queue string, taken []any) error {
	if len(taken) == 0 {
		return nil
	}
	prefix := asynqKeys(queue)
	args := []any{prefix + "t:", s.clock.Now().UnixNano()}
	for i := 0; i+1 < len(taken); i += 2 {
		args = append(args, taken[i])
	}
	moved, err := readyScript.Run(ctx, s.queues, []string{prefix + "pending", prefix + "retry", prefix + "scheduled"}, args...).Int64Slice()
	if err != nil {
		return err
	}
	for i, result := range moved {
		id, _ := taken[2*i].(string)
		overdue, _ := taken[2*i+1].(int64)
		switch {
		case result == 1:
			s.metrics.woken.Inc()
		case result == 2 && overdue < wakeStillActive.Microseconds():
			_ = s.noteWake(ctx, queue, id, wakeAgain, time.Time{})
		}
		// Otherwise gone (it ran, was deleted), pending already, or
		// archived: nothing to do.
	}
	return nil
}
