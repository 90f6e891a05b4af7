package worker

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/sluicehq/sluice/internal/redistest"
	"github.com/sluicehq/sluice/internal/testkit"
)

// TestEndAfterRedisOutage: a task whose handler returns while Redis is
// down (killed, then started again from its append-only file) is done
// once Redis is back, within asynq's next sync (5 s), and never runs
// again. Without keepEnds, asynq's retries of the end fail with a
// cancelled context and the task stays active until its lease has run out.
func TestEndAfterRedisOutage(t *testing.T) {
	srv := redistest.StartServer(t)
	queue := redistest.Queue(t, "ends")
	path := writeConfig(t, fmt.Sprintf(`
redis: {addr: %s}
worker: {concurrency: 2, metrics_addr: %s}
queues: {%s: {}}
tasks: {lib:end: {}}
`, srv.Addr, testkit.FreeAddr(t), queue))
	w, err := New(path, WithLogger(slog.New(slog.DiscardHandler)))
	if err != nil {
		t.Fatal(err)
	}
	var runs atomic.Int32
	release := make(chan struct{})
	w.HandleFunc("lib:end", func(context.Context, *asynq.Task) error {
		runs.Add(1)
		<-release
		return nil
	})
	ctx, cancel := context.WithCancel(context.Background())
	stopped := make(chan error, 1)
	go func() { stopped <- w.Run(ctx) }()
	defer func() {
		cancel()
		<-stopped
	}()

	inspector := asynq.NewInspector(asynq.RedisClientOpt{Addr: srv.Addr})
	defer inspector.Close()
	client := asynq.NewClient(asynq.RedisClientOpt{Addr: srv.Addr})
	defer client.Close()
	info, err := client.Enqueue(asynq.NewTask("lib:end", nil), asynq.Queue(queue), asynq.MaxRetry(0))
	if err != nil {
		t.Fatal(err)
	}
	testkit.WaitFor(t, 10*time.Second, "the handler to start", func() bool { return runs.Load() == 1 })
	srv.Kill()
	close(release)
	time.Sleep(4 * time.Second) // longer than go-redis tries the first write of the end
	srv.Start(t)
	back := time.Now()
	testkit.WaitFor(t, 8*time.Second, "the task to be done", func() bool {
		_, err := inspector.GetTaskInfo(queue, info.ID)
		return errors.Is(err, asynq.ErrTaskNotFound) // done tasks are deleted
	})
	t.Logf("the task was done %v after Redis was back", time.Since(back).Round(100*time.Millisecond))
	if n := runs.Load(); n != 1 {
		t.Errorf("the handler ran %d times, want 1", n)
	}
}
