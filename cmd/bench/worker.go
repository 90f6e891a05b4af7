package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hibiken/asynq"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/jobs"
)

// workerTasks is how many demo:noop tasks each worker measurement runs.
const workerTasks = 20000

// runWorker measures what sluice's gates cost a worker: asynq throughput of
// demo:noop tasks through the Scheduler, with a drain gate and a quota set
// far above the load so that no task waits, beside plain asynq, in the same
// run on the same server; then the Redis commands a task costs, passing at
// once and waiting.
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
		return func(ctx context.Context) (float64, error) {
			r, err := runNoops(ctx, b, opt, cfg, queue, workerTasks)
			return r.rate, err
		}
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

%d demo:noop tasks enqueued up front, then drained by one in-process asynq server (concurrency 20) on the same redis-server: plain, and with sluice's Scheduler middleware whose gates (1,000,000/s) are far above the load, so every task passes at once. Tasks take their turns from leases (throttle.Pool): one script call books a batch of turns on all of a task's gates, a batch lasts at most 500ms, and what it did not hand out is given back. Median of %d rounds, rows interleaved.

| worker | tasks/s | ratio to plain asynq |
|---|--:|--:|
| plain asynq | %s | 1.00 |
| asynq + sluice: drain gate | %s | %.2f |
| asynq + sluice: drain gate + quota | %s | %.2f |
`, workerTasks, b.rounds, grouped(plain),
		grouped(rates["drain gate"]), rates["drain gate"]/plain,
		grouped(rates["drain gate + quota"]), rates["drain gate + quota"]/plain)
	if err := keyedQuota(ctx, b, opt, queue); err != nil {
		return err
	}
	return commandsPerTask(ctx, b, opt, cfg, queue)
}

// keyedValues is how many key values the keyed quota's tasks spread over.
const keyedValues = 1000

// keyedQuota measures a quota keyed by a field of the payload (1,000
// values) beside the same quota unkeyed, on the same tasks, both far above
// the load.
func keyedQuota(ctx context.Context, b *bench, opt asynq.RedisClientOpt, queue string) error {
	const typ = "bench:keyed"
	spec := jobs.LimitConfig{Limit: 1_000_000, Period: time.Second, Burst: 1_000_000}
	keyed := spec
	keyed.Key = "payload.k"
	config := func(quota jobs.LimitConfig) *jobs.Config {
		return &jobs.Config{
			Worker: jobs.WorkerConfig{Concurrency: 20},
			Queues: map[string]jobs.QueueConfig{queue: {}},
			Quotas: map[string]jobs.LimitConfig{b.runID + "-api": quota},
			Tasks:  map[string]jobs.TaskConfig{typ: {Quotas: []string{b.runID + "-api"}}},
		}
	}
	newTask := func(i int) *asynq.Task {
		return asynq.NewTask(typ, fmt.Appendf(nil, `{"k": "v%d"}`, i%keyedValues))
	}
	measure := func(cfg *jobs.Config) func(ctx context.Context) (float64, error) {
		return func(ctx context.Context) (float64, error) {
			r, err := runTasks(ctx, b, opt, cfg, queue, workerTasks, newTask)
			return r.rate, err
		}
	}
	rates, err := inRounds(ctx, b, []measurement{
		{"plain asynq", measure(nil)},
		{"quota", measure(config(spec))},
		{"keyed quota", measure(config(keyed))},
	})
	if err != nil {
		return err
	}
	plain, unkeyed := rates["plain asynq"], rates["quota"]
	fmt.Fprintf(b.out, `
A quota keyed by the task (key: payload.k, %s values spread evenly over the tasks, each value's limit far above its load) beside the same quota unkeyed, on the same %d tasks, no drain. Both lend their turns from leases (throttle.Pool): the unkeyed quota from one pool, the keyed one from a pool per key value (at most 4,096 kept, the least recently used given back). A value's lease serves only that value's tasks within its span (at most 500ms), a few at this load, so the keyed quota still makes a script call every few tasks, where the unkeyed one makes one per lease of up to 256 turns. Median of %d rounds, rows interleaved.

| worker | tasks/s | ratio to plain asynq | ratio to the unkeyed quota |
|---|--:|--:|--:|
| plain asynq | %s | 1.00 | |
| asynq + sluice: quota | %s | %.2f | 1.00 |
| asynq + sluice: quota keyed over %s values | %s | %.2f | %.2f |
`, grouped(keyedValues), workerTasks, b.rounds, grouped(plain),
		grouped(unkeyed), unkeyed/plain,
		grouped(keyedValues), grouped(rates["keyed quota"]), rates["keyed quota"]/plain, rates["keyed quota"]/unkeyed)
	return nil
}

// commandsPerTask measures the Redis commands a task costs (INFO
// commandstats, which counts the commands that scripts run too): plain,
// passing its gates at once, and waiting for its turn in the worker or in
// Redis.
func commandsPerTask(ctx context.Context, b *bench, opt asynq.RedisClientOpt, farAbove jobs.Config, queue string) error {
	// Drains of burst 1, which cannot lend turns: 1,000,000/s, where every
	// task books a turn and passes at once; 1,000/s with 2,000 tasks, where
	// every task waits a little in the worker; 50/s with 400 tasks, 40
	// fetched at once and no holding, where most go back to Redis to wait
	// for their turn (those within about 300ms of it wait in the worker: a
	// trip would take longer).
	drain := func(rate, concurrency, waiting int, holdMax time.Duration) *jobs.Config {
		return &jobs.Config{
			Worker: jobs.WorkerConfig{Concurrency: concurrency, Waiting: waiting, HoldMax: holdMax},
			Queues: map[string]jobs.QueueConfig{queue: {Drain: &jobs.LimitConfig{Limit: rate, Period: time.Second, Burst: 1}}},
		}
	}
	rows := []struct {
		name string
		cfg  *jobs.Config
		n    int
	}{
		{"plain asynq", nil, 4000},
		{"drain gate + quota, far above the load (turns lent)", &farAbove, 4000},
		{"drain 1,000,000/s burst 1: every task books, passes at once", drain(1_000_000, 20, 20, time.Second), 4000},
		{"drain 1,000/s burst 1: every task waits in the worker", drain(1000, 20, 20, time.Second), 2000},
		{"drain 50/s burst 1, concurrency 40, worker.hold_max 1ns: tasks wait in Redis", drain(50, 40, 2, time.Nanosecond), 400},
	}
	fmt.Fprintf(b.out, `
Redis commands per completed task, from INFO commandstats before and after each run (it counts the commands asynq's and sluice's scripts run, and everything the asynq server does meanwhile: heartbeats, the forwarder (every second with sluice, asynq's default of 5s plain), polls of an empty queue, sluice's waker), one asynq server of concurrency 20 unless the row says. What a server does meanwhile grows with the run's length, not with its tasks, so a slow run (a drain of 50/s) pays more of it per task: "idle" is what the same server, on the same config, runs in the same time with no task at all (measured right after), and "net" is the rest, per task:

| worker | tasks | seconds | commands per task | ratio to plain asynq | idle per task | net per task | net ratio to plain asynq | requeued per task |
|---|--:|--:|--:|--:|--:|--:|--:|--:|
`)
	var plain, plainNet float64
	for _, row := range rows {
		b.progress("commands: %s", row.name)
		r, err := runNoops(ctx, b, opt, row.cfg, queue, row.n)
		if err != nil {
			return fmt.Errorf("commands, %s: %w", row.name, err)
		}
		idle, err := serveTasks(ctx, b, opt, row.cfg, queue, 0, r.elapsed, newNoop)
		if err != nil {
			return fmt.Errorf("commands, %s, idle: %w", row.name, err)
		}
		perTask, idlePerTask := r.commands/float64(row.n), idle.commands/float64(row.n)
		net := perTask - idlePerTask
		if row.cfg == nil {
			plain, plainNet = perTask, net
		}
		fmt.Fprintf(b.out, "| %s | %d | %.1f | %.1f | %.2f | %.1f | %.1f | %.2f | %.2f |\n", row.name, row.n, r.elapsed.Seconds(),
			perTask, perTask/plain, idlePerTask, net, net/plainNet, r.requeued/float64(row.n))
	}
	return nil
}

// noopRun is what one runNoops saw.
type noopRun struct {
	rate     float64 // tasks per second
	commands float64 // Redis commands the server ran meanwhile
	requeued float64 // tasks sent back to Redis to wait (sluice_throttled_tasks_total{how="requeued"})
	elapsed  time.Duration
}

// runNoops enqueues n noop tasks, then runs a server until all are done,
// gated by a Scheduler on cfg unless it is nil.
func runNoops(ctx context.Context, b *bench, opt asynq.RedisClientOpt, cfg *jobs.Config, queue string, n int) (noopRun, error) {
	return runTasks(ctx, b, opt, cfg, queue, n, newNoop)
}

func newNoop(int) *asynq.Task {
	task, _ := jobs.NewNoopTask()
	return task
}

// runTasks is runNoops with the tasks newTask makes (the i-th of n, all of
// one type), which the server does nothing with.
func runTasks(ctx context.Context, b *bench, opt asynq.RedisClientOpt, cfg *jobs.Config, queue string, n int, newTask func(i int) *asynq.Task) (noopRun, error) {
	return serveTasks(ctx, b, opt, cfg, queue, n, 0, newTask)
}

// serveTasks is runTasks; with n 0, it serves an empty queue for idle.
func serveTasks(ctx context.Context, b *bench, opt asynq.RedisClientOpt, cfg *jobs.Config, queue string, n int, idle time.Duration, newTask func(i int) *asynq.Task) (noopRun, error) {
	if err := enqueueEach(opt, queue, n, newTask); err != nil {
		return noopRun{}, err
	}
	var done atomic.Int64
	finished := make(chan struct{})
	mux := asynq.NewServeMux()
	mux.HandleFunc(newTask(0).Type(), func(context.Context, *asynq.Task) error {
		if done.Add(1) == int64(n) {
			close(finished)
		}
		return nil
	})
	srvCfg := asynq.Config{Concurrency: 20, Queues: map[string]int{queue: 1}, Logger: quietLogger{}}
	reg := prometheus.NewRegistry()
	if cfg != nil {
		log := slog.New(slog.NewTextHandler(io.Discard, nil))
		sched, err := jobs.NewScheduler(b.rdb, opt, *cfg, jobs.NewMetrics(reg), log)
		if err != nil {
			return noopRun{}, err
		}
		defer sched.Close()
		runCtx, stop := context.WithCancel(ctx)
		defer stop()
		go sched.Run(runCtx) // as cmd/worker does: the wake set brings waiting tasks back on time
		mux.Use(sched.Middleware)
		srvCfg = sched.AsynqConfig()
		srvCfg.Logger = quietLogger{}
	} else {
		srvCfg.TaskCheckInterval = 100 * time.Millisecond // as the Scheduler sets it
	}
	before, err := commandsRun(ctx, b.rdb)
	if err != nil {
		return noopRun{}, err
	}
	srv := asynq.NewServer(opt, srvCfg)
	start := time.Now()
	if err := srv.Start(mux); err != nil {
		return noopRun{}, err
	}
	if n == 0 {
		go func() { time.Sleep(idle); close(finished) }()
	}
	select {
	case <-finished:
	case <-ctx.Done():
		srv.Shutdown()
		return noopRun{}, ctx.Err()
	case <-time.After(5 * time.Minute):
		srv.Shutdown()
		return noopRun{}, fmt.Errorf("only %d of %d tasks done after 5 minutes", done.Load(), n)
	}
	elapsed := time.Since(start)
	rate := float64(n) / elapsed.Seconds()
	after, err := commandsRun(ctx, b.rdb)
	srv.Shutdown()
	if err != nil {
		return noopRun{}, err
	}
	requeued := 0.0
	if cfg != nil {
		if requeued, err = counterSum(reg, "sluice_throttled_tasks_total", "how", "requeued"); err != nil {
			return noopRun{}, err
		}
	}
	// The INFO call that read the counts is one of them.
	return noopRun{rate: rate, commands: float64(after - before - 1), requeued: requeued, elapsed: elapsed}, nil
}

// counterSum adds up the counters of family name whose label is value.
func counterSum(reg *prometheus.Registry, name, label, value string) (float64, error) {
	families, err := reg.Gather()
	if err != nil {
		return 0, err
	}
	sum := 0.0
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == label && l.GetValue() == value {
					sum += m.GetCounter().GetValue()
				}
			}
		}
	}
	return sum, nil
}

// commandsRun is the number of commands the server has run, from INFO
// commandstats.
func commandsRun(ctx context.Context, rdb *redis.Client) (int64, error) {
	info, err := rdb.Info(ctx, "commandstats").Result()
	if err != nil {
		return 0, fmt.Errorf("INFO commandstats: %w", err)
	}
	var total int64
	for line := range strings.Lines(info) {
		// cmdstat_get:calls=12,usec=34,...
		_, rest, ok := strings.Cut(line, ":calls=")
		if !ok {
			continue
		}
		calls, _, _ := strings.Cut(rest, ",")
		n, err := strconv.ParseInt(calls, 10, 64)
		if err != nil {
			return 0, fmt.Errorf("INFO commandstats: %q: %w", strings.TrimSpace(line), err)
		}
		total += n
	}
	return total, nil
}

func enqueueEach(opt asynq.RedisClientOpt, queue string, n int, newTask func(i int) *asynq.Task) error {
	client := asynq.NewClient(opt)
	defer client.Close()
	var wg sync.WaitGroup
	errs := make(chan error, 16)
	for w := 0; w < 16; w++ {
		wg.Go(func() {
			for i := w; i < n; i += 16 {
				if _, err := client.Enqueue(newTask(i), asynq.Queue(queue)); err != nil {
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
