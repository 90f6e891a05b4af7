package test

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/sluicehq/sluice/examples/forecast"
	"github.com/sluicehq/sluice/internal/redistest"
	"github.com/sluicehq/sluice/internal/testkit"
)

// TestHandlerPanics (issue 19.1): two worker processes (test/panicworker),
// a queue drained at 10/s, burst 1, and limited to 1 task at once; 3 of
// its 50 tasks panic in their handler. The other 47 all run, at the drain:
// never beyond 1 + 10·T in any span T, and all within the 50 turns' 4.9 s
// plus 2 s (on main none ran after the first panic: its run token and
// concurrency slot were never given back). The panicking tasks fail with
// the panic in their last error: the two with MaxRetry 0 are archived, the
// one with MaxRetry 1 waits for its retry.
func TestHandlerPanics(t *testing.T) {
	t.Parallel()
	const tasks, perSecond = 50, 10
	u := newUpstream(t)
	queue := redistest.Queue(t, "forecasts")
	config := writeConfig(t, fmt.Sprintf(`
redis: {addr: %s}
queues:
  %s: {drain: {algorithm: leaky_bucket, limit: %d, period: 1s, burst: 1}, concurrency: 1}
`, redistest.Addr(t), queue, perSecond))
	for range 2 {
		startWorkerBinary(t, "test/panicworker", []string{"--config", config, "--api", u.URL})
	}
	panics := map[int]int{5: 0, 20: 0, 35: 1} // task number -> MaxRetry
	client := asynq.NewClient(asynq.RedisClientOpt{Addr: redistest.Addr(t)})
	defer client.Close()
	for i := range tasks {
		city, maxRetry := fmt.Sprintf("city-%d", i), 25
		if r, ok := panics[i]; ok {
			city, maxRetry = fmt.Sprintf("panic-%d", i), r
		}
		task, err := forecast.NewTask(city)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := client.Enqueue(task, asynq.Queue(queue), asynq.MaxRetry(maxRetry)); err != nil {
			t.Fatal(err)
		}
	}

	good := tasks - len(panics)
	testkit.WaitFor(t, 30*time.Second, "the tasks that do not panic to run", func() bool { return len(u.Under("forecast")) >= good })
	time.Sleep(500 * time.Millisecond) // let any duplicate show itself
	arrivals := u.Under("forecast")
	span := arrivals[len(arrivals)-1].Sub(arrivals[0])
	t.Logf("%d of %d tasks that do not panic ran in %v, at %.2f/s", len(arrivals), good, span.Round(time.Millisecond), rate(arrivals))
	if len(arrivals) != good || u.Distinct() != good {
		t.Errorf("%d requests for %d distinct tasks, want %d: tasks lost or run twice", len(arrivals), u.Distinct(), good)
	}
	if over := overAllowance(arrivals, 1, perSecond); over > 0 {
		t.Errorf("%.1f tasks beyond the drain of %d/s, burst 1 (%s)", over, perSecond, densest(arrivals, time.Second))
	}
	if most := time.Duration(tasks-1) * time.Second / perSecond; span > most+2*time.Second {
		t.Errorf("the tasks ran over %v, want the drain's %v for %d turns, plus 2 s", span, most, tasks)
	}

	// A task with no retry left that waits in Redis goes there as a copy
	// under another ID: the panicking tasks are found by their city.
	inspector := asynq.NewInspector(asynq.RedisClientOpt{Addr: redistest.Addr(t)})
	defer inspector.Close()
	failed := map[string]*asynq.TaskInfo{}
	testkit.WaitFor(t, 10*time.Second, "the panicking tasks to fail", func() bool {
		archived, err := inspector.ListArchivedTasks(queue)
		if err != nil {
			t.Fatal(err)
		}
		retrying, err := inspector.ListRetryTasks(queue)
		if err != nil {
			t.Fatal(err)
		}
		clear(failed)
		for _, info := range append(archived, retrying...) {
			var p forecast.Payload
			if err := json.Unmarshal(info.Payload, &p); err != nil {
				t.Fatal(err)
			}
			failed[p.City] = info
		}
		return len(failed) == len(panics)
	})
	for i, maxRetry := range panics {
		city := fmt.Sprintf("panic-%d", i)
		want, retried := asynq.TaskStateArchived, 0
		if maxRetry > 0 {
			want, retried = asynq.TaskStateRetry, 1 // a failure: it spent a retry
		}
		info := failed[city]
		if info == nil || info.State != want || info.Retried != retried || !strings.Contains(info.LastErr, "panic") || !strings.Contains(info.LastErr, "forecast for "+city+" blew up") {
			t.Errorf("%s (MaxRetry %d): %+v; want %v, retried %d, with the panic in its last error", city, maxRetry, info, want, retried)
		}
	}
	if info := redistest.QueueInfo(t, queue); info.Archived != 2 || info.Retry != 1 || info.Pending != 0 || info.Active != 0 || info.Scheduled != 0 {
		t.Errorf("queue after the run: archived %d, retry %d, pending %d, active %d, scheduled %d; want 2 archived, 1 retrying, nothing else left",
			info.Archived, info.Retry, info.Pending, info.Active, info.Scheduled)
	}
}
