package main

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/hibiken/asynq"

	"github.com/sluicehq/sluice/jobs"
	"github.com/sluicehq/sluice/throttle"
)

const (
	backlogWorkers = 3  // worker processes, as in the measurement
	backlogRate    = 20 // the quota, per second
	// backlogWindow is how long each depth is measured, once the workers
	// have taken the backlog (asynq's pending list is empty) and for at
	// least backlogSettle.
	backlogWindow = 30 * time.Second
	backlogSettle = 5 * time.Second
	// backlogHorizon is worker.reserve_max: a backlog deeper than the
	// quota books that far ahead has tasks in its backlog line, whose
	// turns begin after it; those depths are measured from then on.
	backlogHorizon = time.Minute
	// bullMQCommands is BullMQ 6.7's Redis commands per job on the same
	// workload (limiter 20 per 1 s, 3 workers, 20,000 queued, 60 s),
	// measured for issue 20 on this machine: not measured by this run.
	bullMQCommands = 32.8
)

// runBacklog measures what a backlog costs while it waits: 1,000, 10,000
// and 100,000 demo:noop tasks queued behind a token-bucket quota of 20/s
// (burst 20), unkeyed and keyed (all tasks on one key value), drained by 3
// worker processes (the real binary, default worker settings), each
// measured over backlogWindow once the backlog is taken; beside plain asynq
// (3 servers in this process, no gates) draining 10,000 of the same tasks
// as fast as it can.
func runBacklog(ctx context.Context, b *bench) error {
	dir, binary, err := buildWorker(ctx, b, "backlog")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	opt := asynq.RedisClientOpt{Addr: b.addr}

	b.progress("backlog: plain asynq")
	plain, err := plainBacklog(ctx, b, opt)
	if err != nil {
		return fmt.Errorf("plain asynq: %w", err)
	}
	b.progress("backlog: the workers idle")
	idle, err := backlogAt(ctx, b, binary, dir, 0, false)
	if err != nil {
		return fmt.Errorf("idle: %w", err)
	}
	fmt.Fprintf(b.out, `
### backlog: what a waiting task costs

demo:noop tasks queued up front behind a quota of %d/s (token_bucket, burst %d) on %d worker processes (the real binary, built for the run, default worker settings: concurrency 10, waiting 10, hold_max 1s, reserve_max 1m), the handler doing nothing (an upstream that never refuses). A task's life is two visits: the first when the backlog is taken off asynq's pending list and booked (parked and booked by the parker, or taken by a worker and sent back to Redis; a task that runs then has only that visit), the last near its turn (back from Redis, it claims its turn and runs). The first visits are measured from the workers' start until the pending list is empty and every task waiting in Redis is noted in the wake set (booked), per task not done by then (the tasks done meanwhile counted at a last visit's cost); the last visits over %v from then, at least %v after the workers start, or %v for a backlog deeper than the turns of worker.reserve_max (1,200), so that the window covers the tasks that rested in the backlog line: "window from" is that time, and delivered/s its tasks done. Commands and script runs (EVALSHA, EVAL, FCALL) are INFO commandstats deltas, per task, so they include everything the fleet does meanwhile (asynq's heartbeats and forwarder, sluice's waker and parker); worker CPU is the %d processes' user + system time (/proc) over the window. Keyed: the quota keyed by `+"`type`"+`, every task on that one key value. Plain asynq: %d servers in this process, no gates, draining 10,000 of the same tasks as fast as they can (%.2f script runs and %.1f commands per task over their life). BullMQ 6.7 on the same workload (limiter 20 per 1 s, 3 workers, 20,000 queued, 60 s) made %.1f commands per job, measured for issue 20 on this machine, not by this run.

The same %d workers on the same config with no task at all run %.1f script runs and %.0f commands a second (asynq polling an empty queue every 100 ms, its forwarder and heartbeats, sluice's waker and its watchers, the fleet's housekeeping), whatever the depth: at %d tasks a second that is %.2f script runs and %.1f commands per task, included in the last visits' figures.

| quota | queued | window from | delivered/s | of the quota | script runs: first visit | last visit | over its life | life, beyond plain asynq | commands: first visit | last visit | over its life | commands/s | worker CPU ms/s |
|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|
`, backlogRate, backlogRate, backlogWorkers, backlogWindow, backlogSettle, backlogSettle+backlogHorizon, backlogWorkers, backlogWorkers, plain.scripts, plain.commands, bullMQCommands,
		backlogWorkers, idle.scripts, idle.commands, backlogRate, idle.scripts/backlogRate, idle.commands/backlogRate)
	for _, keyed := range []bool{false, true} {
		for _, depth := range []int{1_000, 10_000, 100_000} {
			name := "unkeyed"
			if keyed {
				name = "keyed, one value"
			}
			b.progress("backlog: %s, %d queued", name, depth)
			r, err := backlogAt(ctx, b, binary, dir, depth, keyed)
			if err != nil {
				return fmt.Errorf("%s, %d queued: %w", name, depth, err)
			}
			scripts, commands := r.scripts/r.rate, r.commands/r.rate
			fmt.Fprintf(b.out, "| %s | %s | %.1f s | %.2f | %.1f%% | %.2f | %.2f | %.2f | %+.2f | %.1f | %.1f | %.1f | %s | %.0f |\n", name, grouped(float64(depth)), r.taken.Seconds(),
				r.rate, 100*r.rate/backlogRate, r.firstScripts, scripts, r.firstScripts+scripts, r.firstScripts+scripts-plain.scripts,
				r.firstCommands, commands, r.firstCommands+commands, grouped(r.commands), r.workerCPU)
		}
	}
	return nil
}

// backlogRun is what one backlog measurement saw over its window, per
// second (plainBacklog's: per task).
type backlogRun struct {
	taken    time.Duration
	rate     float64 // tasks completed
	scripts  float64
	commands float64
	// workerCPU is the workers' CPU time, together, in ms per second.
	workerCPU float64
	// firstScripts and firstCommands are what a task's first visit cost,
	// per task (the backlog taken from the pending list).
	firstScripts, firstCommands float64
}

// plainBacklog drains 10,000 tasks with plain asynq and returns its
// script runs and commands per task.
func plainBacklog(ctx context.Context, b *bench, opt asynq.RedisClientOpt) (backlogRun, error) {
	const n = 10_000
	queue := b.runID + "-backlog-plain"
	if err := enqueueEach(opt, queue, n, newNoop); err != nil {
		return backlogRun{}, err
	}
	before, err := commandsRun(ctx, b.rdb)
	if err != nil {
		return backlogRun{}, err
	}
	inspector := asynq.NewInspector(opt)
	defer inspector.Close()
	defer inspector.DeleteQueue(queue, true)
	for range backlogWorkers {
		mux := asynq.NewServeMux()
		mux.HandleFunc(jobs.TypeNoop, func(context.Context, *asynq.Task) error { return nil })
		srv := asynq.NewServer(opt, asynq.Config{Concurrency: 10, Queues: map[string]int{queue: 1}, Logger: quietLogger{}, TaskCheckInterval: 100 * time.Millisecond})
		if err := srv.Start(mux); err != nil {
			return backlogRun{}, err
		}
		defer srv.Shutdown()
	}
	for deadline := time.Now().Add(5 * time.Minute); ; time.Sleep(50 * time.Millisecond) {
		info, err := inspector.GetQueueInfo(queue)
		if err != nil {
			return backlogRun{}, err
		}
		if info.ProcessedTotal >= n {
			break
		}
		if time.Now().After(deadline) {
			return backlogRun{}, fmt.Errorf("only %d of %d tasks done after 5 minutes", info.ProcessedTotal, n)
		}
	}
	after, err := commandsRun(ctx, b.rdb)
	if err != nil {
		return backlogRun{}, err
	}
	return backlogRun{scripts: float64(after.scripts-before.scripts) / n, commands: float64(after.all-before.all) / n}, nil
}

// backlogAt queues depth tasks, starts the workers, waits until they have
// taken the backlog, and measures over backlogWindow.
func backlogAt(ctx context.Context, b *bench, binary, dir string, depth int, keyed bool) (backlogRun, error) {
	queue := fmt.Sprintf("%s-backlog-%d", b.runID, depth)
	key := ""
	if keyed {
		queue += "-keyed"
		key = ", key: type"
	}
	config := filepath.Join(dir, queue+".yaml")
	yaml := fmt.Sprintf("redis: {addr: %q}\nqueues:\n  %s: {}\nquotas:\n  %s-api: {algorithm: token_bucket, limit: %d, period: 1s, burst: %d%s}\ntasks:\n  %s: {quotas: [%s-api]}\n",
		b.addr, queue, queue, backlogRate, backlogRate, key, jobs.TypeNoop, queue)
	if err := os.WriteFile(config, []byte(yaml), 0o644); err != nil {
		return backlogRun{}, err
	}
	opt := asynq.RedisClientOpt{Addr: b.addr}
	inspector := asynq.NewInspector(opt)
	defer inspector.Close()
	defer b.deleteMatching("*" + queue + "*")
	if err := enqueueEach(opt, queue, depth, newNoop); err != nil {
		return backlogRun{}, err
	}
	var workers []*exec.Cmd
	defer func() {
		for _, w := range workers {
			w.Process.Signal(syscall.SIGTERM)
		}
		for _, w := range workers {
			w.Wait()
		}
	}()
	settle := backlogSettle
	if depth > int(backlogRate*backlogHorizon.Seconds()) {
		settle += backlogHorizon
	}
	before, err := commandsRun(ctx, b.rdb)
	if err != nil {
		return backlogRun{}, err
	}
	start := time.Now()
	for range backlogWorkers {
		w := exec.CommandContext(ctx, binary, "--config", config)
		w.Env = append(os.Environ(), "SLUICE_WORKER_METRICS_ADDR="+freeLoopback())
		if err := w.Start(); err != nil {
			return backlogRun{}, err
		}
		workers = append(workers, w)
	}
	// The first visits: from the workers' start until the backlog is out
	// of the pending list and every task waiting in Redis is noted in the
	// wake set, booked (parked and booked by the parker, or taken by a
	// worker and sent back).
	var taken commandCount
	var doneTaken int
	for deadline := start.Add(10 * time.Minute); ; time.Sleep(100 * time.Millisecond) {
		pending, done, err := queueCounts(inspector, queue)
		if err != nil {
			return backlogRun{}, err
		}
		if pending == 0 && taken.byName == nil && depth > 0 {
			info, err := inspector.GetQueueInfo(queue)
			if err != nil {
				return backlogRun{}, err
			}
			noted, err := b.rdb.ZCard(ctx, throttle.Key("sluice:wake:", queue)).Result()
			if err != nil {
				return backlogRun{}, err
			}
			if int64(info.Retry+info.Scheduled) <= noted {
				if taken, err = commandsRun(ctx, b.rdb); err != nil {
					return backlogRun{}, err
				}
				doneTaken = done
			}
		}
		if pending == 0 && (taken.byName != nil || depth == 0) && time.Since(start) >= settle {
			break
		}
		if time.Now().After(deadline) {
			return backlogRun{}, fmt.Errorf("%d tasks pending, the backlog not all booked after 10 minutes", pending)
		}
	}
	r := backlogRun{taken: time.Since(start)}
	sample := func() (commandCount, int, time.Duration, error) {
		count, err := commandsRun(ctx, b.rdb)
		if err != nil {
			return count, 0, 0, err
		}
		_, processed, err := queueCounts(inspector, queue)
		if err != nil {
			return count, 0, 0, err
		}
		cpu := time.Duration(0)
		for _, w := range workers {
			c, err := processCPU(w.Process.Pid)
			if err != nil {
				return count, 0, 0, err
			}
			cpu += c
		}
		return count, processed, cpu, nil
	}
	c0, done0, cpu0, err := sample()
	if err != nil {
		return r, err
	}
	from := time.Now()
	select {
	case <-ctx.Done():
		return r, ctx.Err()
	case <-time.After(backlogWindow):
	}
	c1, done1, cpu1, err := sample()
	if err != nil {
		return r, err
	}
	window := time.Since(from).Seconds()
	if depth > 0 && done1 == done0 {
		return r, fmt.Errorf("no task completed in %v", backlogWindow)
	}
	if depth > 0 {
		b.progress("backlog: %d queued: commands per task by name, first visits: %s", depth, taken.perTask(before, depth-doneTaken))
		b.progress("backlog: %d queued: commands per task by name, last visits: %s", depth, c1.perTask(c0, done1-done0))
	} else {
		b.progress("backlog: the workers idle: commands a second by name: %s", c1.perTask(c0, int(window)))
	}
	r.rate = float64(done1-done0) / window
	r.scripts = float64(c1.scripts-c0.scripts) / window
	r.commands = float64(c1.all-c0.all) / window
	r.workerCPU = (cpu1 - cpu0).Seconds() * 1000 / window
	if depth > doneTaken {
		// What the first visits cost, per task that had one: the tasks
		// done meanwhile cost what a last visit does.
		first := float64(depth - doneTaken)
		r.firstScripts = (float64(taken.scripts-before.scripts) - float64(doneTaken)*r.scripts/r.rate) / first
		r.firstCommands = (float64(taken.all-before.all) - float64(doneTaken)*r.commands/r.rate) / first
	}
	return r, nil
}

// queueCounts is how many tasks of queue are pending and how many asynq
// has processed: none of either for a queue that never had a task.
func queueCounts(inspector *asynq.Inspector, queue string) (pending, processed int, err error) {
	queues, err := inspector.Queues()
	if err != nil || !slices.Contains(queues, queue) {
		return 0, 0, err
	}
	info, err := inspector.GetQueueInfo(queue)
	if err != nil {
		return 0, 0, err
	}
	return info.Pending, info.ProcessedTotal, nil
}

// processCPU is the user + system CPU time process pid has used, from
// /proc/<pid>/stat.
func processCPU(pid int) (time.Duration, error) {
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	// The fields after the command name, which is in parentheses: utime
	// and stime are the 12th and 13th, in clock ticks (100 a second).
	_, rest, ok := strings.Cut(string(stat), ") ")
	fields := strings.Fields(rest)
	if !ok || len(fields) < 13 {
		return 0, fmt.Errorf("/proc/%d/stat: cannot read %q", pid, stat)
	}
	utime, err1 := strconv.ParseInt(fields[11], 10, 64)
	stime, err2 := strconv.ParseInt(fields[12], 10, 64)
	if err1 != nil || err2 != nil {
		return 0, fmt.Errorf("/proc/%d/stat: cannot read %q", pid, stat)
	}
	return time.Duration(utime+stime) * 10 * time.Millisecond, nil
}
