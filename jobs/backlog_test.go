package jobs

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/internal/redistest"
	"github.com/sluicehq/sluice/internal/testkit"
)

// TestBacklogBooksBoundedTimes (issue 20, item 8: a backlog costs nothing
// while it waits): tasks queued far beyond worker.reserve_max (here 1 s of
// a 30/s drain, so 30 turns; 300 tasks, 10 s of turns) each make a bounded
// number of script runs of sluice's before they run, whatever their place
// in the queue: at most 3 per completed task (a task refused once books
// once more when its turn is near; the waker's looks are counted too). A
// refused task used to ask again about a second later, each time, until
// its turn came: about N/(2·rate) asks for a task on average (5 here), each
// a booking and a note. It counts the script runs of its own clients only,
// so it runs beside the package's other tests that wait.
func TestBacklogBooksBoundedTimes(t *testing.T) {
	t.Parallel()
	for name, rdb := range map[string]redis.UniversalClient{"redis": redistest.Client(t), "cluster": redistest.Cluster(t)} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			testBacklogBooksBoundedTimes(t, rdb)
		})
	}
}

// testBacklogBooksBoundedTimes is TestBacklogBooksBoundedTimes with the
// limits on rdb.
func testBacklogBooksBoundedTimes(t *testing.T, rdb redis.UniversalClient) {
	queue := redistest.Queue(t, "q")
	// sluice's scripts run as scripts (EVALSHA) or, where the server has
	// functions, the limits' as functions (FCALL).
	scripts, functions := &scriptCalls{command: "evalsha"}, &scriptCalls{command: "fcall"}
	rdb.AddHook(scripts)
	rdb.AddHook(functions)
	s := newScheduler(t, rdb, Config{
		Worker: WorkerConfig{Concurrency: 10, ReserveMax: time.Second},
		Queues: map[string]QueueConfig{queue: {Drain: &LimitConfig{Limit: 30, Period: time.Second, Burst: 1}}},
	})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go s.Run(ctx)
	var done atomic.Int64
	mux := asynq.NewServeMux()
	mux.Use(s.Middleware)
	mux.HandleFunc("test:record", func(context.Context, *asynq.Task) error {
		done.Add(1)
		return nil
	})
	client := asynq.NewClient(asynq.RedisClientOpt{Addr: redistest.Addr(t)})
	defer client.Close()
	const n = 300
	for i := range n {
		if _, err := client.Enqueue(asynq.NewTask("test:record", nil), asynq.Queue(queue), asynq.TaskID(fmt.Sprint("t", i))); err != nil {
			t.Fatal(err)
		}
	}
	scripts.count.Store(0)
	functions.count.Store(0)
	serve(t, s, mux)
	testkit.WaitFor(t, 60*time.Second, "every task to run", func() bool { return done.Load() == n })
	runs := scripts.count.Load() + functions.count.Load()
	perTask := float64(runs) / n
	deferred := testutil.ToFloat64(s.metrics.decisions.WithLabelValues("drain:"+queue, "deferred"))
	t.Logf("%d tasks: %d script runs of sluice's (%.2f per task), %.0f deferred decisions", n, runs, perTask, deferred)
	if perTask > 3 {
		t.Errorf("%.2f script runs of sluice's per completed task, want at most 3: a task refused its turn asks again and again", perTask)
	}
}
