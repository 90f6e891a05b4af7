package test

import (
	"fmt"
	"testing"
	"time"

	"github.com/sluicehq/sluice/internal/redistest"
	"github.com/sluicehq/sluice/internal/testkit"
)

// TestDrainAccuracy: one queue drains at 20/s (leaky bucket, burst 1)
// however many workers consume it. 400 http:request tasks from a plain
// asynq.Client, half with MaxRetry 0, against a local server that notes
// every request: the rate within 2% of 20/s, no second with more than 21,
// every task done once, none archived or failed; limiter calls at most one
// per task and one per return from Redis, plus a fifth of the tasks (about
// 1.9 a task measured), and at most 1.1 trips to Redis per task.
func TestDrainAccuracy(t *testing.T) {
	t.Parallel()
	for _, workers := range []int{1, 3, 8} {
		t.Run(fmt.Sprintf("%d workers", workers), func(t *testing.T) {
			t.Parallel()
			const tasks = 400
			u := newUpstream(t)
			queue := redistest.Queue(t, "drain")
			config := writeConfig(t, fmt.Sprintf(`
redis: {addr: %s}
worker: {concurrency: 10}
queues:
  %s: {drain: {algorithm: leaky_bucket, limit: 20, period: 1s, burst: 1}}
http: {allow: ['%s']}
`, redistest.Addr(t), queue, u.Listener.Addr().String()))
			var fleet []*worker
			for i := 0; i < workers; i++ {
				fleet = append(fleet, startWorker(t, config))
			}
			enqueueRequests(t, u, queue, "drain", tasks)
			testkit.WaitFor(t, 40*time.Second, "all requests", func() bool { return len(u.All()) >= tasks })
			time.Sleep(500 * time.Millisecond) // let any duplicate show itself

			arrivals := u.All()
			rate := float64(len(arrivals)-1) / arrivals[len(arrivals)-1].Sub(arrivals[0]).Seconds()
			most := testkit.MaxInWindow(arrivals, time.Second)
			var calls, requeued float64
			for _, w := range fleet {
				calls += w.counter(t, "sluice_bookings_total")
				// A task parked from the queue (jobs/park.go) waited in
				// Redis as one sent back does.
				requeued += w.counter(t, "sluice_throttled_tasks_total", `how="requeued"`) +
					w.counter(t, "sluice_throttled_tasks_total", `how="parked"`)
			}
			t.Logf("%d workers: %d requests, %.3f/s, at most %d in a second, %.3f limiter calls and %.3f trips to Redis per task",
				workers, len(arrivals), rate, most, calls/tasks, requeued/tasks)
			if len(arrivals) != tasks || u.Distinct() != tasks {
				t.Errorf("%d requests for %d distinct tasks, want %d of %d: tasks lost or run twice", len(arrivals), u.Distinct(), tasks, tasks)
			}
			if rate < 19.6 || rate > 20.4 {
				t.Errorf("drained at %.3f/s, want 20/s within 2%%", rate)
			}
			if most > 21 {
				_, from := testkit.DensestWindow(arrivals, time.Second)
				t.Errorf("%d requests within one second, want at most 21; from %v after the first, the gaps between them and the next, ms: %v",
					most, arrivals[from].Sub(arrivals[0]).Round(time.Millisecond), testkit.Gaps(arrivals, from, most+2))
			}
			// A task books once; one that waited in Redis asks once more, for
			// the turn kept under its ID.
			if calls > tasks+requeued+0.2*tasks {
				t.Errorf("%v limiter calls for %d tasks of which %v waited in Redis, want at most one each and one per return (+20%%)", calls, tasks, requeued)
			}
			if requeued > 1.1*tasks {
				t.Errorf("%v trips to Redis for %d tasks, want at most 1.1 per task", requeued, tasks)
			}
			info := redistest.QueueInfo(t, queue)
			// asynq counts a task processed when its handler succeeds, and
			// when it is revoked: a task with no retry left waits in Redis as
			// a copy, and the original is revoked. The retry path (tasks with
			// retries left) is not counted: waiting is not a failure.
			t.Logf("asynq processed %d for %d tasks", info.ProcessedTotal, tasks)
			if float64(info.ProcessedTotal) > 2.1*tasks {
				t.Errorf("asynq processed %d for %d tasks, want at most 2.1 per task", info.ProcessedTotal, tasks)
			}
			if info.Archived != 0 || info.Retry != 0 || info.Failed != 0 || info.Pending != 0 || info.Scheduled != 0 || info.Active != 0 {
				t.Errorf("queue after the run: archived %d, retry %d, failed today %d, pending %d, scheduled %d, active %d; want all 0",
					info.Archived, info.Retry, info.Failed, info.Pending, info.Scheduled, info.Active)
			}
		})
	}
}
