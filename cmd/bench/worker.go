package main

import (
	"cmp"
	"context"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
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
	costs := taskCosts{}
	measure := costs.measure(b, opt, queue, newNoop)
	rates, err := eachRound(ctx, b, b.workerRounds, []measurement{
		measure("plain asynq", nil),
		measure("drain gate", &drainOnly),
		measure("drain gate + quota", &cfg),
	})
	if err != nil {
		return err
	}
	fmt.Fprintf(b.out, `
### worker: what the gates cost

%s demo:noop tasks enqueued up front, then drained by one in-process asynq server (concurrency 20) on the same redis-server: plain, and with sluice's Scheduler middleware whose gates (1,000,000/s) are far above the load, so every task passes at once. Tasks take their turns from leases (throttle.Pool): one script call books a batch of turns on all of a task's gates, a batch lasts at most 1s (here, the window less a batch's server time), and what it did not hand out is given back. %s

| worker | tasks/s, median | CPU per task, median | ratio to plain asynq |
|---|--:|--:|--:|
| plain asynq | %s | %s | 1.00 |
`, grouped(workerTasks), roundsNote(b), grouped(median(rates["plain asynq"])), costs.cpu("plain asynq"))
	for _, row := range []string{"drain gate", "drain gate + quota"} {
		fmt.Fprintf(b.out, "| asynq + sluice: %s | %s | %s | %s |\n", row, grouped(median(rates[row])), costs.cpu(row), ratioCell(rates, row, "plain asynq"))
	}
	return commandsPerTask(ctx, b, opt, cfg, queue)
}

// keyedValues is how many key values the keyed quota's tasks spread over.
const keyedValues = 1000

// runKeyed measures a quota keyed by a field of the payload (1,000 values)
// beside the same quota unkeyed, on the same tasks, both far above the load.
func runKeyed(ctx context.Context, b *bench) error {
	const typ = "bench:keyed"
	queue := b.runID + "-keyed"
	opt := asynq.RedisClientOpt{Addr: b.addr}
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
	costs := taskCosts{}
	measure := costs.measure(b, opt, queue, newTask)
	rates, err := eachRound(ctx, b, b.workerRounds, []measurement{
		measure("plain asynq", nil),
		measure("quota", config(spec)),
		measure("keyed quota", config(keyed)),
	})
	if err != nil {
		return err
	}
	fmt.Fprintf(b.out, `
### keyed: a quota per key value

A quota keyed by the task (key: payload.k, %s values spread evenly over the tasks, each value's limit far above its load) beside the same quota unkeyed, on the same %s tasks, no drain, one in-process asynq server (concurrency 20). Both lend their turns from leases (throttle.Pool): the unkeyed quota from one pool, the keyed one from a pool per key value (at most 4,096 kept, the least recently used given back). A value's lease serves only that value's tasks within its span (at most 1s, the bucket's window less a lease's server time), some 7 or 8 at this load, so the keyed quota still makes a script call every few tasks, where the unkeyed one makes one per lease of up to 256 turns. Script runs per task are EVALSHA calls from INFO commandstats (asynq's own included: plain asynq's are the baseline). %s

| worker | tasks/s, median | script runs per task | CPU per task, median | ratio to plain asynq | ratio to the unkeyed quota |
|---|--:|--:|--:|--:|--:|
| plain asynq | %s | %s | %s | 1.00 | |
| asynq + sluice: quota | %s | %s | %s | %s | 1.00 |
| asynq + sluice: quota keyed over %s values | %s | %s | %s | %s | %s |
`, grouped(keyedValues), grouped(workerTasks), roundsNote(b),
		grouped(median(rates["plain asynq"])), costs.scriptRuns("plain asynq"), costs.cpu("plain asynq"),
		grouped(median(rates["quota"])), costs.scriptRuns("quota"), costs.cpu("quota"), ratioCell(rates, "quota", "plain asynq"),
		grouped(keyedValues), grouped(median(rates["keyed quota"])), costs.scriptRuns("keyed quota"), costs.cpu("keyed quota"),
		ratioCell(rates, "keyed quota", "plain asynq"), ratioCell(rates, "keyed quota", "quota"))
	return nil
}

// roundsNote says how the worker sections' figures were made.
func roundsNote(b *bench) string {
	return fmt.Sprintf("%d rounds, each running every row once, one after another (every other round in reverse order). A row's ratio is the median of its rounds' own ratios, each to the run beside it in its round, with the lowest and highest in brackets: this shared machine's speed drifts from one run to the next. CPU per task is what this process and redis-server used during the run (getrusage and INFO cpu) over its tasks; steal on a shared machine inflates it too.", b.workerRounds)
}

// taskCosts collects, per measurement name, each run's costs.
type taskCosts map[string][]noopRun

// measure returns a measurement of runs of workerTasks tasks that newTask
// makes, gated by cfg (plain asynq if nil), recording each run.
func (tc taskCosts) measure(b *bench, opt asynq.RedisClientOpt, queue string, newTask func(int) *asynq.Task) func(string, *jobs.Config) measurement {
	return func(name string, cfg *jobs.Config) measurement {
		return measurement{name, func(ctx context.Context) (float64, error) {
			r, err := runTasks(ctx, b, opt, cfg, queue, workerTasks, newTask)
			tc[name] = append(tc[name], r)
			return r.rate, err
		}}
	}
}

// cpu is the median CPU time per task of name's runs.
func (tc taskCosts) cpu(name string) string {
	var perTask []float64
	for _, r := range tc[name] {
		perTask = append(perTask, float64(r.cpu.Microseconds())/workerTasks)
	}
	return fmt.Sprintf("%.0f µs", median(perTask))
}

// scriptRuns is the median script runs per task of name's runs.
func (tc taskCosts) scriptRuns(name string) string {
	var perTask []float64
	for _, r := range tc[name] {
		perTask = append(perTask, r.scripts/workerTasks)
	}
	return fmt.Sprintf("%.2f", median(perTask))
}

// ratioCell is a's ratio to b for a table: the median of the rounds' own
// ratios, the lowest and highest in brackets.
func ratioCell(rates roundRates, a, b string) string {
	mid, lo, hi := rates.ratio(a, b)
	return fmt.Sprintf("%.2f (%.2f–%.2f)", mid, lo, hi)
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
	rate     float64       // tasks per second
	commands float64       // Redis commands the server ran meanwhile
	scripts  float64       // of which script runs (EVALSHA, EVAL)
	cpu      time.Duration // CPU time this process and the server used meanwhile
	requeued float64       // tasks sent back to Redis to wait (sluice_throttled_tasks_total{how="requeued"})
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
	return noopRun{rate: rate, commands: float64(after.all - before.all - 1), scripts: float64(after.scripts - before.scripts),
		cpu: after.cpu - before.cpu, requeued: requeued, elapsed: elapsed}, nil
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

// commandCount is how many commands the server has run, how many of them
// were script runs, and the CPU time it and this process have used.
type commandCount struct {
	all, scripts int64
	byName       map[string]int64 // calls by command name
	usecByName   map[string]int64 // the server's time in each, µs (INFO commandstats' usec)
	cpu          time.Duration
}

// perTask is what the commands of count less those of before came to per
// task, by command name, most first: "name n.nn, ...".
func (count commandCount) perTask(before commandCount, tasks int) string {
	return byNamePerTask(count.byName, before.byName, tasks, "%s %.2f")
}

// timePerTask is the server's time in the commands of count less those of
// before, per task, by command name, most first: "name n.n µs, ...". A
// script's time includes the commands it runs, which are listed too.
func (count commandCount) timePerTask(before commandCount, tasks int) string {
	return byNamePerTask(count.usecByName, before.usecByName, tasks, "%s %.1f µs")
}

// byNamePerTask lists, most first, what each name's figure in now grew by
// since before, per task, each formatted by format (the name, then the
// figure), joined by ", ".
func byNamePerTask(now, before map[string]int64, tasks int, format string) string {
	type row struct {
		name string
		n    int64
	}
	var rows []row
	for name, n := range now {
		if d := n - before[name]; d > 0 {
			rows = append(rows, row{name, d})
		}
	}
	slices.SortFunc(rows, func(a, b row) int { return cmp.Compare(b.n, a.n) })
	var out []string
	for _, r := range rows {
		out = append(out, fmt.Sprintf(format, r.name, float64(r.n)/float64(max(tasks, 1))))
	}
	return strings.Join(out, ", ")
}

// commandsRun counts the commands the server has run, from INFO
// commandstats, and the CPU time used so far (INFO cpu and getrusage).
func commandsRun(ctx context.Context, rdb *redis.Client) (commandCount, error) {
	count := commandCount{byName: map[string]int64{}, usecByName: map[string]int64{}}
	var self syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &self); err != nil {
		return count, fmt.Errorf("getrusage: %w", err)
	}
	count.cpu = time.Duration(self.Utime.Nano() + self.Stime.Nano())
	info, err := rdb.Info(ctx, "commandstats", "cpu").Result()
	if err != nil {
		return count, fmt.Errorf("INFO commandstats cpu: %w", err)
	}
	for line := range strings.Lines(info) {
		line = strings.TrimSpace(line)
		if field, value, ok := strings.Cut(line, ":"); ok && (field == "used_cpu_sys" || field == "used_cpu_user") {
			seconds, err := strconv.ParseFloat(value, 64)
			if err != nil {
				return count, fmt.Errorf("INFO cpu: %q: %w", line, err)
			}
			count.cpu += time.Duration(seconds * float64(time.Second))
			continue
		}
		// cmdstat_get:calls=12,usec=34,...
		name, rest, ok := strings.Cut(line, ":calls=")
		if !ok {
			continue
		}
		calls, rest, _ := strings.Cut(rest, ",")
		n, err := strconv.ParseInt(calls, 10, 64)
		if err != nil {
			return count, fmt.Errorf("INFO commandstats: %q: %w", line, err)
		}
		if usec, ok := strings.CutPrefix(rest, "usec="); ok {
			usec, _, _ = strings.Cut(usec, ",")
			if count.usecByName[strings.TrimPrefix(name, "cmdstat_")], err = strconv.ParseInt(usec, 10, 64); err != nil {
				return count, fmt.Errorf("INFO commandstats: %q: %w", line, err)
			}
		}
		count.all += n
		count.byName[strings.TrimPrefix(name, "cmdstat_")] = n
		if name == "cmdstat_evalsha" || name == "cmdstat_eval" || name == "cmdstat_fcall" {
			count.scripts += n
		}
	}
	return count, nil
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
