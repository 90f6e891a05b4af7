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
// hold it (taking a slot) or send it round again. Instead every worker
// takes the tasks due from the wake set and moves them to pending
// (asynq's Inspector.RunTask) on time; if no worker does, asynq's own
// forwarder still brings them, a little late, and they book again.
const (
	wakeBatch   = 100                    // tasks one look moves at most
	wakeMaxIdle = 200 * time.Millisecond // the longest between two looks
	wakeMinIdle = 10 * time.Millisecond
	wakeLatest  = time.Second // how much later than due asynq brings a task back by itself
)

var wakeScript = redis.NewScript(lua.Wake)

func wakeKey(queue string) string { return throttle.Key("sluice:wake:", queue) }

// noteWake notes that task id of queue is due back in wait.
func (s *Scheduler) noteWake(ctx context.Context, queue, id string, wait time.Duration) error {
	return wakeScript.Run(ctx, s.rdb, []string{wakeKey(queue)}, s.scriptNow(), "note", id, wait.Microseconds()).Err()
}

// scriptNow is the clock a script reads: Redis's own, or the injected one.
func (s *Scheduler) scriptNow() string {
	if s.injected {
		return strconv.FormatInt(s.clock.Now().UnixMicro(), 10)
	}
	return ""
}

// wake moves the tasks due back to pending, in every queue, until ctx ends.
func (s *Scheduler) wake(ctx context.Context) {
	for {
		idle := wakeMaxIdle
		for queue := range s.Config().Queues {
			if next, ok := s.wakeQueue(ctx, queue); ok {
				idle = min(idle, next)
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-s.clock.After(max(idle, wakeMinIdle)):
		}
	}
}

// wakeQueue moves queue's tasks that are due to pending, and returns how
// soon the next one is due.
func (s *Scheduler) wakeQueue(ctx context.Context, queue string) (time.Duration, bool) {
	reply, err := wakeScript.Run(ctx, s.rdb, []string{wakeKey(queue)}, s.scriptNow(), "take", wakeBatch).Slice()
	if err != nil || len(reply) == 0 {
		return 0, false
	}
	for _, v := range reply[1:] {
		id, _ := v.(string)
		// Gone (it ran, was deleted) or already pending: nothing to do.
		_ = s.inspector.RunTask(queue, id)
		s.metrics.woken.Inc()
	}
	next, _ := reply[0].(int64)
	if next < 0 {
		return 0, false
	}
	return time.Duration(next) * time.Microsecond, true
}
