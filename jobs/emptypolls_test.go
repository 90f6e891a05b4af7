package jobs

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/internal/redistest"
	"github.com/sluicehq/sluice/internal/testkit"
)

// TestEmptyPolls: an asynq server whose client has the EmptyPolls hook
// runs no script while its queue is empty (it polls with LLEN and ZCOUNT:
// the hook knows asynq's dequeue and forward scripts by their keys, which
// this pins against the asynq of go.mod), and still runs every task:
// pending, scheduled and retried, each once, none from a paused queue.
func TestEmptyPolls(t *testing.T) {
	t.Parallel()
	queue := redistest.Queue(t, "q")
	rdb := redistest.Client(t)
	polls, looks := &pollScripts{}, &scriptCalls{command: "llen"}
	rdb.AddHook(&EmptyPolls{})
	rdb.AddHook(polls) // after EmptyPolls: they count what reaches Redis
	rdb.AddHook(looks)

	var mu sync.Mutex
	ran := map[string]int{}
	mux := asynq.NewServeMux()
	fails := map[string]bool{"retried": true}
	mux.HandleFunc("test:poll", func(ctx context.Context, task *asynq.Task) error {
		id, _ := asynq.GetTaskID(ctx)
		mu.Lock()
		defer mu.Unlock()
		ran[id]++
		if fails[id] {
			fails[id] = false
			return context.DeadlineExceeded // retried a second later
		}
		return nil
	})
	srv := asynq.NewServerFromRedisClient(rdb, asynq.Config{
		Concurrency: 2, Queues: map[string]int{queue: 1}, LogLevel: asynq.FatalLevel,
		TaskCheckInterval: taskCheck, DelayedTaskCheckInterval: delayedTaskCheck,
		RetryDelayFunc: func(int, error, *asynq.Task) time.Duration { return time.Second },
	})
	if err := srv.Start(mux); err != nil {
		t.Fatal(err)
	}
	defer srv.Shutdown()

	// Idle: the polls reach Redis as LLEN, not as asynq's scripts.
	time.Sleep(time.Second)
	if n, l := polls.count.Load(), looks.count.Load(); n > 0 || l < 3 {
		t.Errorf("idle for 1s: %d runs of asynq's dequeue and forward scripts and %d LLEN polls, want none and some", n, l)
	}

	client := asynq.NewClient(asynq.RedisClientOpt{Addr: redistest.Addr(t)})
	defer client.Close()
	enqueue := func(id string, opts ...asynq.Option) {
		t.Helper()
		if _, err := client.Enqueue(asynq.NewTask("test:poll", nil), append(opts, asynq.Queue(queue), asynq.TaskID(id), asynq.MaxRetry(1))...); err != nil {
			t.Fatal(err)
		}
	}
	// A queue with tasks is polled by the script alone: after a dequeue
	// that took a task, the next goes straight to it.
	const batch = 40
	inspector := asynq.NewInspector(asynq.RedisClientOpt{Addr: redistest.Addr(t)})
	defer inspector.Close()
	if err := inspector.PauseQueue(queue); err != nil {
		t.Fatal(err)
	}
	for i := range batch {
		enqueue(fmt.Sprint("batch-", i))
	}
	before := looks.count.Load()
	if err := inspector.UnpauseQueue(queue); err != nil {
		t.Fatal(err)
	}
	testkit.WaitFor(t, 10*time.Second, "the batch to run", func() bool {
		mu.Lock()
		defer mu.Unlock()
		n := 0
		for i := range batch {
			n += ran[fmt.Sprint("batch-", i)]
		}
		return n == batch
	})
	if n := looks.count.Load() - before; n > batch/4 {
		t.Errorf("%d tasks taken from a full queue with %d LLEN polls, want at most %d: a dequeue after one that took a task needs no look", batch, n, batch/4)
	}

	// Tasks that come one at a time cost one dequeue script each: none
	// runs after a task to find the queue empty.
	dequeues := func() int64 {
		t.Helper()
		polls.mu.Lock()
		defer polls.mu.Unlock()
		return polls.dequeues
	}
	before = dequeues()
	const single = 8
	for i := range single {
		id := fmt.Sprint("single-", i)
		enqueue(id)
		testkit.WaitFor(t, 5*time.Second, id+" to run", func() bool {
			mu.Lock()
			defer mu.Unlock()
			return ran[id] == 1
		})
		time.Sleep(250 * time.Millisecond) // a few empty polls
	}
	if n := dequeues() - before; n != single {
		t.Errorf("%d tasks enqueued one at a time ran %d dequeue scripts, want one each", single, n)
	}

	enqueue("pending")
	enqueue("scheduled", asynq.ProcessIn(1500*time.Millisecond))
	enqueue("retried")
	testkit.WaitFor(t, 10*time.Second, "the pending, scheduled and retried tasks to run", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return ran["pending"] == 1 && ran["scheduled"] == 1 && ran["retried"] == 2
	})

	if err := inspector.PauseQueue(queue); err != nil {
		t.Fatal(err)
	}
	enqueue("paused")
	time.Sleep(500 * time.Millisecond)
	mu.Lock()
	if ran["paused"] != 0 {
		t.Errorf("a task of a paused queue ran")
	}
	mu.Unlock()
	if err := inspector.UnpauseQueue(queue); err != nil {
		t.Fatal(err)
	}
	testkit.WaitFor(t, 5*time.Second, "the task to run once its queue is unpaused", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return ran["paused"] == 1
	})
	mu.Lock()
	defer mu.Unlock()
	for id, n := range ran {
		if want := map[string]int{"retried": 2}[id]; n != max(want, 1) {
			t.Errorf("%s ran %d times, want %d", id, n, max(want, 1))
		}
	}
}

// pollScripts counts the runs of asynq's dequeue and forward scripts, and
// of the dequeue script alone.
type pollScripts struct {
	count    atomic.Int64
	mu       sync.Mutex
	dequeues int64
}

func (c *pollScripts) DialHook(next redis.DialHook) redis.DialHook { return next }

func (c *pollScripts) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		keys, _ := scriptCall(cmd)
		if isDequeue(keys) || isForward(keys) {
			c.count.Add(1)
		}
		if isDequeue(keys) {
			c.mu.Lock()
			c.dequeues++
			c.mu.Unlock()
		}
		return next(ctx, cmd)
	}
}

func (c *pollScripts) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}
