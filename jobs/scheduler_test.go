package jobs_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/internal/redistest"
	"github.com/sluicehq/sluice/internal/testkit"
	"github.com/sluicehq/sluice/jobs"
)

// recorder is a handler that notes when each task ran, by payload.
type recorder struct{ testkit.Timeline }

func (r *recorder) ProcessTask(ctx context.Context, t *asynq.Task) error {
	r.Note(string(t.Payload()))
	return nil
}

// fleet runs n in-process asynq servers with the scheduler on cfg.
func fleet(t *testing.T, cfg jobs.Config, n int, handler asynq.Handler) (*jobs.Metrics, *prometheus.Registry) {
	t.Helper()
	reg := prometheus.NewRegistry()
	metrics := jobs.NewMetrics(reg)
	for range n {
		startWorker(t, redistest.Client(t), cfg, metrics, handler)
	}
	return metrics, reg
}

// startWorker runs an in-process asynq server on the standalone server
// with the scheduler on cfg, whose limits live on rdb, until the test
// ends.
func startWorker(t *testing.T, rdb redis.UniversalClient, cfg jobs.Config, metrics *jobs.Metrics, handler asynq.Handler, opts ...jobs.Option) {
	t.Helper()
	opt := asynq.RedisClientOpt{Addr: redistest.Addr(t)}
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	sched, err := jobs.NewScheduler(rdb, opt, cfg, metrics, log, opts...)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	go sched.Run(ctx)
	mux := asynq.NewServeMux()
	mux.Use(sched.Middleware)
	mux.Handle("test:record", handler)
	srv := asynq.NewServer(opt, sched.AsynqConfig())
	if err := srv.Start(mux); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		srv.Shutdown()
		cancel()
		sched.Close()
	})
}

func enqueue(t *testing.T, queue string, n int, opts ...asynq.Option) {
	t.Helper()
	client := asynq.NewClient(asynq.RedisClientOpt{Addr: redistest.Addr(t)})
	defer client.Close()
	for i := 0; i < n; i++ {
		task := asynq.NewTask("test:record", []byte(fmt.Sprint(i)))
		if _, err := client.Enqueue(task, append([]asynq.Option{asynq.Queue(queue)}, opts...)...); err != nil {
			t.Fatal(err)
		}
	}
}

// TestDrainGateSpacesTasks: 60 tasks with MaxRetry 0 through a drain of
// 20/s, burst 1, on two workers: every task runs once, none is
// archived or failed, no second holds more than 21, and each costs one
// limiter call.
func TestDrainGateSpacesTasks(t *testing.T) {
	queue := redistest.Queue(t, "q")
	cfg := jobs.Config{
		Worker: jobs.WorkerConfig{Concurrency: 10},
		Queues: map[string]jobs.QueueConfig{queue: {Drain: &jobs.LimitConfig{Limit: 20, Period: time.Second, Burst: 1}}},
	}
	rec := &recorder{}
	_, reg := fleet(t, cfg, 2, rec)
	const tasks = 60
	enqueue(t, queue, tasks, asynq.MaxRetry(0))
	testkit.WaitFor(t, 15*time.Second, "all tasks to run", func() bool { return len(rec.All()) >= tasks })
	time.Sleep(200 * time.Millisecond)

	starts := rec.All()
	if len(starts) != tasks || rec.Distinct() != tasks {
		t.Fatalf("%d runs of %d distinct tasks, want %d of %d", len(starts), rec.Distinct(), tasks, tasks)
	}
	if most := testkit.MaxInWindow(starts, time.Second); most > 21 {
		t.Errorf("%d tasks ran within one second, want at most 21", most)
	}
	rate := float64(tasks-1) / starts[len(starts)-1].Sub(starts[0]).Seconds()
	if rate < 19.6 || rate > 20.4 {
		t.Errorf("drained at %.2f/s, want 20/s within 2%%", rate)
	}
	info := redistest.QueueInfo(t, queue)
	if info.Archived != 0 || info.Retry != 0 || info.Failed != 0 || info.Pending != 0 || info.Scheduled != 0 {
		t.Errorf("queue after the run: %+v, want nothing archived, retrying, failed or left", info)
	}
	// A task books once; one that waited in Redis (sent back, or parked
	// from the queue) asks once more, for the turn kept under its ID.
	calls, requeued := counterSum(t, reg, "sluice_bookings_total"), counterSum(t, reg, "sluice_throttled_tasks_total", "requeued", "parked")
	if calls > tasks+requeued+0.2*tasks {
		t.Errorf("%v limiter calls for %d tasks of which %v waited in Redis, want at most one each and one per return (+20%%)", calls, tasks, requeued)
	}
	t.Logf("rate %.3f/s, %.2f limiter calls and %.2f trips to Redis per task", rate, calls/tasks, requeued/tasks)
}

// counterSum adds up a counter family in reg, of the samples with a label
// value in match if given.
func counterSum(t *testing.T, reg *prometheus.Registry, name string, match ...string) float64 {
	t.Helper()
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	sum := 0.0
	for _, f := range families {
		if f.GetName() == name {
			for _, m := range f.GetMetric() {
				if len(match) == 0 || slices.ContainsFunc(m.GetLabel(), func(l *dto.LabelPair) bool { return slices.Contains(match, l.GetValue()) }) {
					sum += m.GetCounter().GetValue()
				}
			}
		}
	}
	return sum
}

// gauge is a handler that notes how many tasks run at once.
type gauge struct {
	running, most, done atomic.Int64
}

func (g *gauge) ProcessTask(ctx context.Context, t *asynq.Task) error {
	now := g.running.Add(1)
	for {
		most := g.most.Load()
		if now <= most || g.most.CompareAndSwap(most, now) {
			break
		}
	}
	time.Sleep(100 * time.Millisecond)
	g.running.Add(-1)
	g.done.Add(1)
	return nil
}

// TestConcurrencyLimitIsFleetWide: a queue limited to 2 tasks at once, on
// two workers of 10 slots each, never runs more than 2, and runs them all.
func TestConcurrencyLimitIsFleetWide(t *testing.T) {
	t.Parallel()
	queue := redistest.Queue(t, "q")
	cfg := jobs.Config{
		Worker: jobs.WorkerConfig{Concurrency: 10},
		Queues: map[string]jobs.QueueConfig{queue: {Concurrency: 2}},
	}
	g := &gauge{}
	fleet(t, cfg, 2, g)
	enqueue(t, queue, 20)
	testkit.WaitFor(t, 20*time.Second, "all tasks", func() bool { return g.done.Load() == 20 })
	if most := g.most.Load(); most != 2 {
		t.Fatalf("at most %d tasks ran at once, want the limit 2 (and reached)", most)
	}
	if info := redistest.QueueInfo(t, queue); info.Archived != 0 || info.Retry != 0 {
		t.Fatalf("queue after the run: %+v, want nothing archived or retrying", info)
	}
}
