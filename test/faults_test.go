package test

import (
	"fmt"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/sluicehq/sluice/internal/redistest"
	"github.com/sluicehq/sluice/internal/testkit"
	"github.com/sluicehq/sluice/jobs"
)

// TestWorkerKilled: kill -9 of one of three workers mid-run, on the
// standalone server and on the 3-master cluster, loses no task: each of
// 200 (half with MaxRetry 0) runs, nothing is left archived, pending or
// waiting, no handler run fails on the workers that live; only the tasks
// the killed worker had in flight (at most its concurrency, 10) run twice,
// and only those count as failed (a worker death is its task's failure).
// asynq's recoverer gives them back once their lease has been over for
// 30 s, one to two minutes after the kill: both backends wait side by
// side, apart from the tests that measure rates.
func TestWorkerKilled(t *testing.T) {
	t.Parallel()
	for _, b := range backends {
		t.Run(b.name, func(t *testing.T) {
			t.Parallel()
			const tasks, inFlight = 200, 10
			queue := redistest.Queue(t, "q")
			r := startFleet(t, b, 3, fmt.Sprintf(`
worker: {concurrency: %d}
queues:
  %s: {drain: {limit: 20, period: 1s, burst: 1}}
`, inFlight, queue))
			r.enqueue(t, queue, "r", tasks)
			u := r.u
			testkit.WaitFor(t, 20*time.Second, "the run to get going", func() bool { return len(u.All()) >= 60 })
			if err := r.fleet[0].cmd.Process.Signal(syscall.SIGKILL); err != nil {
				t.Fatal(err)
			}
			killed := time.Now()
			r.fleet = r.fleet[1:] // the living
			inspector := asynq.NewInspector(b.asynqOpt(t))
			defer inspector.Close()
			for deadline := time.Now().Add(170 * time.Second); u.Distinct() < tasks; time.Sleep(200 * time.Millisecond) {
				if time.Now().After(deadline) {
					t.Fatalf("%d of %d tasks ran 170 s after the kill; the queue holds %s", u.Distinct(), tasks, queueTasks(t, inspector, queue))
				}
			}
			// A task the killed worker had made its copy of (to wait in
			// Redis) but not yet revoked is still its, as active, when the
			// copy has run: asynq's recoverer takes it back once its lease
			// is over (30 s), and it may run again then.
			var info *asynq.QueueInfo
			testkit.WaitFor(t, 150*time.Second, "the queue to settle", func() bool {
				var err error
				if info, err = inspector.GetQueueInfo(queue); err != nil {
					t.Fatal(err)
				}
				return info.Archived+info.Retry+info.Pending+info.Scheduled+info.Active == 0
			})
			time.Sleep(time.Second) // let any further duplicate show itself
			dups := len(u.All()) - u.Distinct()
			t.Logf("%d tasks, %d requests, %d run twice; the last %v after the kill", tasks, len(u.All()), dups, u.All()[len(u.All())-1].Sub(killed).Round(time.Second))
			if u.Distinct() != tasks {
				t.Errorf("%d distinct tasks ran, want %d", u.Distinct(), tasks)
			}
			if dups > inFlight {
				t.Errorf("%d tasks ran twice, want at most the killed worker's %d in flight", dups, inFlight)
			}
			if failed := r.counter(t, "sluice_tasks_processed_total", `result="error"`); failed > 0 {
				t.Errorf("%v handler runs failed on the living workers, want 0", failed)
			}
			info, err := inspector.GetQueueInfo(queue)
			if err != nil {
				t.Fatal(err)
			}
			if info.Archived+info.Retry+info.Pending+info.Scheduled+info.Active != 0 || info.Failed > inFlight {
				t.Errorf("queue after the run: archived %d, retry %d, pending %d, scheduled %d, active %d, failed today %d; want 0 and at most %d failed",
					info.Archived, info.Retry, info.Pending, info.Scheduled, info.Active, info.Failed, inFlight)
			}
		})
	}
}

// TestRedisRestart: redis-server (appendonly, fsync always) is killed and
// started again mid-run: no task is lost and no worker needs a restart.
func TestRedisRestart(t *testing.T) {
	t.Parallel()
	const tasks = 150
	srv := redistest.StartServer(t)
	u := newUpstream(t)
	queue := redistest.Queue(t, "q")
	config := writeConfig(t, fmt.Sprintf(`
redis: {addr: %s}
queues:
  %s: {drain: {limit: 20, period: 1s, burst: 1}}
http: {allow: ['%s']}
`, srv.Addr, queue, u.Listener.Addr().String()))
	for range 2 {
		startWorker(t, config)
	}
	client := asynq.NewClient(asynq.RedisClientOpt{Addr: srv.Addr})
	defer client.Close()
	for i := 0; i < tasks; i++ {
		task, _ := jobs.NewHTTPRequestTask(jobs.HTTPRequestPayload{URL: fmt.Sprintf("%s/r/%d", u.URL, i)})
		if _, err := client.Enqueue(task, asynq.Queue(queue), asynq.MaxRetry(0)); err != nil {
			t.Fatal(err)
		}
	}
	testkit.WaitFor(t, 20*time.Second, "the run to get going", func() bool { return len(u.All()) >= 40 })
	srv.Kill()
	time.Sleep(time.Second)
	srv.Start(t)
	testkit.WaitFor(t, 150*time.Second, "every task", func() bool { return u.Distinct() >= tasks })
	t.Logf("%d tasks, %d requests", tasks, len(u.All()))
}

// queueTasks describes what queue holds, state by state, each task with
// its last error and when asynq will next process it: what a test that
// waits in vain for tasks shows.
func queueTasks(t *testing.T, inspector *asynq.Inspector, queue string) string {
	t.Helper()
	var b strings.Builder
	lists := []struct {
		state string
		list  func(string, ...asynq.ListOption) ([]*asynq.TaskInfo, error)
	}{
		{"pending", inspector.ListPendingTasks}, {"active", inspector.ListActiveTasks},
		{"scheduled", inspector.ListScheduledTasks}, {"retry", inspector.ListRetryTasks},
		{"archived", inspector.ListArchivedTasks},
	}
	for _, l := range lists {
		infos, err := l.list(queue, asynq.PageSize(20))
		if err != nil {
			fmt.Fprintf(&b, "\n%s: %v", l.state, err)
			continue
		}
		for _, info := range infos {
			fmt.Fprintf(&b, "\n%s %s: retried %d/%d, next %v, last error %q", l.state, info.ID, info.Retried, info.MaxRetry,
				time.Until(info.NextProcessAt).Round(time.Second), info.LastErr)
		}
	}
	if b.Len() == 0 {
		return " nothing"
	}
	return b.String()
}
