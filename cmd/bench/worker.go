package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hibiken/asynq"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/sluicehq/sluice/jobs"
)

// workerTasks is how many demo:noop tasks each worker measurement runs.
const workerTasks = 20000

// runWorker measures what sluice's gates cost a worker: asynq throughput of
// demo:noop tasks through the Scheduler, with a drain gate and a quota set
// far above the load so that no task waits, beside plain asynq, in the same
// run on the same server.
func runWorker(ctx context.Context, b *bench) error {
	queue := b.runID + "-worker"
	cfg := jobs.Config{
		Worker: jobs.WorkerConfig{Concurrency: 20},
		Queues: map[string]jobs.QueueConfig{queue: {Drain: &jobs.LimitConfig{Limit: 1_000_000, Period: time.Second, Burst: 1_000_000}}},
		Quotas: map[string]jobs.LimitConfig{b.runID + "-api": {Limit: 1_000_000, Period: time.Second, Burst: 1_000_000}},
		Tasks:  map[string]jobs.TaskConfig{jobs.TypeNoop: {Quotas: []string{b.runID + "-api"}}},
	}
	drainOnly := cfg
	drainOnly.Tasks = nil
	opt := asynq.RedisClientOpt{Addr: b.addr}
	measure := func(cfg *jobs.Config) func(ctx context.Context) (float64, error) {
		return func(ctx context.Context) (float64, error) { return runNoops(ctx, b, opt, cfg, queue) }
	}
	rates, err := inRounds(ctx, b, []measurement{
		{"plain asynq", measure(nil)},
		{"drain gate", measure(&drainOnly)},
		{"drain gate + quota", measure(&cfg)},
	})
	if err != nil {
		return err
	}
	plain := rates["plain asynq"]
	fmt.Fprintf(b.out, `
### worker: what the gates cost

%d demo:noop tasks enqueued up front, then drained by one in-process asynq server (concurrency 20) on the same redis-server: plain, and with sluice's Scheduler middleware whose gates (1,000,000/s) are far above the load, so every task passes at once: one limiter call per gate. Median of %d rounds, rows interleaved.

| worker | tasks/s | ratio to plain asynq |
|---|--:|--:|
| plain asynq | %s | 1.00 |
| asynq + sluice: drain gate | %s | %.2f |
| asynq + sluice: drain gate + quota | %s | %.2f |
`, workerTasks, b.rounds, grouped(plain),
		grouped(rates["drain gate"]), rates["drain gate"]/plain,
		grouped(rates["drain gate + quota"]), rates["drain gate + quota"]/plain)
	return nil
}

// runNoops enqueues workerTasks noop tasks, then runs a server until all
// are done, gated by a Scheduler on cfg unless it is nil, and returns the
// tasks per second of the draining.
func runNoops(ctx context.Context, b *bench, opt asynq.RedisClientOpt, cfg *jobs.Config, queue string) (float64, error) {
	if err := enqueueNoops(opt, queue, workerTasks); err != nil {
		return 0, err
	}
	var done atomic.Int64
	finished := make(chan struct{})
	mux := asynq.NewServeMux()
	mux.HandleFunc(jobs.TypeNoop, func(context.Context, *asynq.Task) error {
		if done.Add(1) == workerTasks {
			close(finished)
		}
		return nil
	})
	srvCfg := asynq.Config{Concurrency: 20, Queues: map[string]int{queue: 1}, Logger: quietLogger{}}
	if cfg != nil {
		log := slog.New(slog.NewTextHandler(io.Discard, nil))
		sched, err := jobs.NewScheduler(b.rdb, opt, *cfg, jobs.NewMetrics(prometheus.NewRegistry()), log)
		if err != nil {
			return 0, err
		}
		defer sched.Close()
		mux.Use(sched.Middleware)
		srvCfg = sched.AsynqConfig()
		srvCfg.Logger = quietLogger{}
	} else {
		srvCfg.TaskCheckInterval = 100 * time.Millisecond // as the Scheduler sets it
	}
	srv := asynq.NewServer(opt, srvCfg)
	start := time.Now()
	if err := srv.Start(mux); err != nil {
		return 0, err
	}
	defer srv.Shutdown()
	select {
	case <-finished:
	case <-ctx.Done():
		return 0, ctx.Err()
	case <-time.After(5 * time.Minute):
		return 0, fmt.Errorf("only %d of %d tasks done after 5 minutes", done.Load(), workerTasks)
	}
	return workerTasks / time.Since(start).Seconds(), nil
}

func enqueueNoops(opt asynq.RedisClientOpt, queue string, n int) error {
	client := asynq.NewClient(opt)
	defer client.Close()
	var wg sync.WaitGroup
	errs := make(chan error, 16)
	for w := 0; w < 16; w++ {
		wg.Go(func() {
			for i := w; i < n; i += 16 {
				task, _ := jobs.NewNoopTask()
				if _, err := client.Enqueue(task, asynq.Queue(queue)); err != nil {
					errs <- err
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	return <-errs
}

// quietLogger keeps asynq's start and stop lines out of the bench output.
type quietLogger struct{}

func (quietLogger) Debug(...any) {}
func (quietLogger) Info(...any)  {}
func (quietLogger) Warn(...any)  {}
func (quietLogger) Error(...any) {}
func (quietLogger) Fatal(...any) {}
