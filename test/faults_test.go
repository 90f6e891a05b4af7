package test

import (
	"fmt"
	"syscall"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/sluicehq/sluice/internal/redistest"
	"github.com/sluicehq/sluice/internal/testkit"
	"github.com/sluicehq/sluice/jobs"
)

// TestWorkerKilled: kill -9 of one of three workers mid-run loses no task;
// at most the tasks it had in flight (its concurrency) run twice. asynq's
// recoverer gives them back once their lease ends (about a minute).
func TestWorkerKilled(t *testing.T) {
	const tasks = 200
	u := newUpstream(t)
	queue := redistest.Queue(t, "q")
	config := writeConfig(t, fmt.Sprintf(`
redis: {addr: %s}
worker: {concurrency: 10}
queues:
  %s: {drain: {limit: 20, period: 1s, burst: 1}}
http: {allow: ['%s']}
`, redisAddr(t), queue, u.Listener.Addr().String()))
	var fleet []*worker
	for range 3 {
		fleet = append(fleet, startWorker(t, config))
	}
	enqueueRequests(t, u, queue, "r", tasks)
	testkit.WaitFor(t, 20*time.Second, "the run to get going", func() bool { return len(u.All()) >= 60 })
	if err := fleet[0].cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	testkit.WaitFor(t, 150*time.Second, "every task", func() bool { return u.Distinct() >= tasks })
	time.Sleep(time.Second)
	dups := len(u.All()) - u.Distinct()
	t.Logf("%d tasks, %d requests, %d run twice", tasks, len(u.All()), dups)
	if u.Distinct() != tasks {
		t.Errorf("%d distinct tasks ran, want %d", u.Distinct(), tasks)
	}
	if dups > 10 {
		t.Errorf("%d tasks ran twice, want at most the killed worker's 10 in flight", dups)
	}
}

// TestRedisRestart: redis-server (appendonly, fsync always) is killed and
// started again mid-run: no task is lost and no worker needs a restart.
func TestRedisRestart(t *testing.T) {
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
