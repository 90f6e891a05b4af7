package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
)

const (
	fleetTasks   = 400 // the fleet drain: 400 tasks at 20/s on 3 workers
	fleetRate    = 20
	fleetWorkers = 3
	// fleetPoll is how often the bench asks whether the last task is done:
	// one command a poll, taken out of the counts.
	fleetPoll = 50 * time.Millisecond
	// fleetInfoCalls is the INFO calls one serverUseNow sends: a span
	// from one counts them, not those of the one that ends it.
	fleetInfoCalls = 2
	// bullMQ is the peer, as scripts/bullmq/package.json pins it.
	bullMQ = "BullMQ 6.7.6"
)

// runFleet measures issue 25's fleet drain side by side with BullMQ on the
// same redis-server: 400 no-op tasks enqueued one call each, then drained
// at 20/s by 3 worker processes, each contender in turn, every other round
// the other first.
func runFleet(ctx context.Context, b *bench) error {
	dir, binary, err := buildWorker(ctx, b, "fleet")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	runs := map[string][]fleetRun{}
	measure := func(name string, drain func(ctx context.Context, queue string) (fleetRun, error)) measurement {
		return measurement{name, func(ctx context.Context) (float64, error) {
			queue := fmt.Sprintf("%s-fleet-%s-%d", b.runID, strings.Fields(name)[0], len(runs[name]))
			r, err := drain(ctx, queue)
			runs[name] = append(runs[name], r)
			return fleetTasks / r.drain.Seconds(), err
		}}
	}
	measurements := []measurement{measure("sluice", func(ctx context.Context, queue string) (fleetRun, error) {
		return sluiceFleet(ctx, b, binary, dir, queue)
	})}
	harness, skipped := bullMQHarness(ctx, b)
	if skipped != "" {
		b.progress("fleet: %s skipped: %s", bullMQ, skipped)
	} else {
		measurements = append(measurements, measure(bullMQ, func(ctx context.Context, queue string) (fleetRun, error) {
			return bullMQFleet(ctx, b, harness, queue)
		}))
	}
	if _, err := eachRound(ctx, b, b.rounds, measurements); err != nil {
		return err
	}

	fmt.Fprintf(b.out, `
### fleet: a throttled drain beside %s

Issue 25's fleet drain, each contender in turn on the same redis-server, %d rounds (every other round the other first). sluice: %d demo:noop tasks enqueued by this process with asynq's Client.Enqueue, one call per task (16 goroutines), then drained by %d worker processes (the real binary, built for the run, default worker settings: concurrency 10) through the queue's drain {algorithm: leaky_bucket, limit: %d, period: 1s} (burst: its default, the limit: %d may run back to back). %s (scripts/bullmq): %d jobs named noop added by node produce.js with queue.add, one awaited call per job, default job options (so BullMQ keeps every completed job, as it does for a user who sets nothing), then drained by %d node work.js processes, each one Worker of concurrency 10 with limiter {max: %d, duration: 1000} (a fixed window of 1 s, shared by all of the queue's workers). Both handlers do nothing. Times: from the producer's start to the workers' start (enqueue; node's start included for %s), and from the workers' start until the bench sees the last task done (drain; delivered/s is the tasks over it). The bench polls for that every %v with one command (GET asynq:{queue}:processed for sluice, ZCARD bull:queue:completed for %s), and counts its polls: they and its own INFO calls are taken out of the commands. Commands are INFO commandstats deltas over all commands, from the producer's start until the last task done, per task (so they include everything each fleet does meanwhile: asynq's polls, heartbeats and forwarder, sluice's waker and fleet housekeeping; BullMQ's job events stream and its workers' stalled-job checks); "of which enqueue" is the producer's part; script runs are EVALSHA, EVAL and FCALL (and their _RO forms) among them. Redis CPU: INFO cpu used_cpu_user + used_cpu_sys over the same span (the server's housekeeping included), in ms per task. Worker CPU: the %d worker processes' user + system time (/proc) from their start until the last task done, their start included (node loading BullMQ), in ms per task. Each cell is the median of the rounds, lowest and highest in brackets; the last row's ratios are the medians of the rounds' own ratios.

| | enqueue, s | drain, s | delivered/s | commands per task | of which enqueue | script runs per task | of which enqueue | Redis CPU ms per task | of which enqueue | worker CPU ms per task |
|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|
`, bullMQ, b.rounds, fleetTasks, fleetWorkers, fleetRate, fleetRate, bullMQ, fleetTasks, fleetWorkers, fleetRate, bullMQ, fleetPoll, bullMQ, fleetWorkers)
	for _, name := range []string{"sluice", bullMQ} {
		if len(runs[name]) == 0 {
			continue
		}
		cell := func(prec int, figure func(fleetRun) float64) string {
			var xs []float64
			for _, r := range runs[name] {
				xs = append(xs, figure(r))
			}
			return spreadCell(prec, xs)
		}
		fmt.Fprintf(b.out, "| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", name,
			cell(2, func(r fleetRun) float64 { return r.enqueue.Seconds() }),
			cell(2, func(r fleetRun) float64 { return r.drain.Seconds() }),
			cell(2, func(r fleetRun) float64 { return fleetTasks / r.drain.Seconds() }),
			cell(2, func(r fleetRun) float64 { return r.life.commands }),
			cell(2, func(r fleetRun) float64 { return r.enqueued.commands }),
			cell(2, func(r fleetRun) float64 { return r.life.scripts }),
			cell(2, func(r fleetRun) float64 { return r.enqueued.scripts }),
			cell(3, func(r fleetRun) float64 { return r.life.redisMS }),
			cell(3, func(r fleetRun) float64 { return r.enqueued.redisMS }),
			cell(2, func(r fleetRun) float64 { return r.workerMS }))
	}
	if skipped != "" {
		fmt.Fprintf(b.out, "\n%s was skipped: %s.\n", bullMQ, skipped)
		return nil
	}
	ratio := func(figure func(fleetRun) float64) string {
		var xs []float64
		for i, r := range runs["sluice"] {
			xs = append(xs, figure(r)/figure(runs[bullMQ][i]))
		}
		return spreadCell(2, xs)
	}
	fmt.Fprintf(b.out, "| sluice / %s | | | | %s | | | | %s | | |\n", bullMQ,
		ratio(func(r fleetRun) float64 { return r.life.commands }), ratio(func(r fleetRun) float64 { return r.life.redisMS }))
	return nil
}

// spreadCell is the median of xs with the lowest and highest in brackets,
// each to prec decimals.
func spreadCell(prec int, xs []float64) string {
	return fmt.Sprintf("%.*f [%.*f–%.*f]", prec, median(xs), prec, slices.Min(xs), prec, slices.Max(xs))
}

// fleetRun is what one contender's drain cost.
type fleetRun struct {
	enqueue, drain time.Duration
	// life is per task from the producer's start until the last task done,
	// enqueued the producer's part of it.
	life, enqueued serverCost
	workerMS       float64 // the workers' CPU, per task
}

// serverCost is what the server ran between two serverUses, per task.
type serverCost struct {
	commands, scripts float64
	redisMS           float64 // CPU
}

// serverUse is what the server had run by one moment.
type serverUse struct {
	count    commandCount
	redisCPU time.Duration
}

func serverUseNow(ctx context.Context, b *bench) (serverUse, error) {
	count, err := commandsRun(ctx, b.rdb)
	if err != nil {
		return serverUse{}, err
	}
	cpu, err := redisCPU(ctx, b)
	return serverUse{count, cpu}, err
}

// since is what the server ran from before until u, per task, less the
// bench's own commands among them.
func (u serverUse) since(before serverUse, own int) serverCost {
	scripts := func(c commandCount) int64 {
		return c.scripts + c.byName["fcall_ro"] + c.byName["evalsha_ro"] + c.byName["eval_ro"]
	}
	return serverCost{
		commands: float64(u.count.all-before.count.all-int64(own)) / fleetTasks,
		scripts:  float64(scripts(u.count)-scripts(before.count)) / fleetTasks,
		redisMS:  (u.redisCPU - before.redisCPU).Seconds() * 1000 / fleetTasks,
	}
}

// fleetDrain measures one contender: enqueue runs the producer, start
// starts a worker process, and done asks the server, with one command,
// how many tasks are done.
func fleetDrain(ctx context.Context, b *bench, name string, enqueue func() error, start func() (*exec.Cmd, error), done func() (int, error)) (fleetRun, error) {
	var r fleetRun
	before, err := serverUseNow(ctx, b)
	if err != nil {
		return r, err
	}
	begun := time.Now()
	if err := enqueue(); err != nil {
		return r, fmt.Errorf("enqueue: %w", err)
	}
	r.enqueue = time.Since(begun)
	enqueued, err := serverUseNow(ctx, b)
	if err != nil {
		return r, err
	}
	var workers []*exec.Cmd
	defer func() { stopProcesses(workers) }()
	started := time.Now()
	for range fleetWorkers {
		w, err := start()
		if err != nil {
			return r, fmt.Errorf("start a worker: %w", err)
		}
		workers = append(workers, w)
	}
	polls := 0
	// steady: the server's use from the moment a tenth of the tasks were
	// done, past the workers' start (printed as progress: where the rest of
	// the drain's cost goes).
	var steady serverUse
	steadyFrom, steadyPolls := -1, 0
	for deadline := started.Add(5 * time.Minute); ; {
		polls++
		n, err := done()
		if err != nil {
			return r, err
		}
		if n >= fleetTasks {
			break
		}
		if steadyFrom < 0 && n >= fleetTasks/10 {
			if steady, err = serverUseNow(ctx, b); err != nil {
				return r, err
			}
			steadyFrom, steadyPolls = n, polls
		}
		if time.Now().After(deadline) {
			return r, fmt.Errorf("%d tasks not done after 5 minutes", fleetTasks)
		}
		select {
		case <-ctx.Done():
			return r, ctx.Err()
		case <-time.After(fleetPoll):
		}
	}
	r.drain = time.Since(started)
	var cpu time.Duration
	for _, w := range workers {
		c, err := processCPU(w.Process.Pid)
		if err != nil {
			return r, err
		}
		cpu += c
	}
	r.workerMS = cpu.Seconds() * 1000 / fleetTasks
	after, err := serverUseNow(ctx, b)
	if err != nil {
		return r, err
	}
	r.enqueued = enqueued.since(before, fleetInfoCalls)
	r.life = after.since(before, 2*fleetInfoCalls+polls)
	if steadyFrom >= 0 {
		tasks := fleetTasks - steadyFrom
		c := after.since(steady, fleetInfoCalls+polls-steadyPolls)
		scale := float64(fleetTasks) / float64(tasks) // since's figures are per fleetTasks
		b.progress("fleet: %s: from the %d-th task done on, per task: %.1f commands, %.2f script runs, %.3f ms of Redis CPU; the server's time in them: %s",
			name, steadyFrom, c.commands*scale, c.scripts*scale, c.redisMS*scale, after.count.timePerTask(steady.count, tasks))
	}
	b.progress("fleet: %s: commands per task by name, the drain (polls and INFO included): %s", name, after.count.perTask(enqueued.count, fleetTasks))
	b.progress("fleet: %s: the server's time in them per task, the drain: %s", name, after.count.timePerTask(enqueued.count, fleetTasks))
	err = stopProcesses(workers)
	workers = nil
	return r, err
}

// stopProcesses stops ps as a deploy would (SIGTERM), killing any that
// has not exited after 30 s, and reports those that did not exit cleanly.
func stopProcesses(ps []*exec.Cmd) error {
	for _, p := range ps {
		p.Process.Signal(syscall.SIGTERM)
	}
	var errs []error
	for _, p := range ps {
		kill := time.AfterFunc(30*time.Second, func() { p.Process.Kill() })
		if err := p.Wait(); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", strings.Join(p.Args, " "), err))
		}
		kill.Stop()
	}
	return errors.Join(errs...)
}

// sluiceFleet drains fleetTasks demo:noop tasks with the worker binary.
func sluiceFleet(ctx context.Context, b *bench, binary, dir, queue string) (fleetRun, error) {
	config := filepath.Join(dir, queue+".yaml")
	yaml := fmt.Sprintf("redis: {addr: %q}\nqueues:\n  %s: {drain: {algorithm: leaky_bucket, limit: %d, period: 1s}}\n", b.addr, queue, fleetRate)
	if err := os.WriteFile(config, []byte(yaml), 0o644); err != nil {
		return fleetRun{}, err
	}
	defer b.deleteMatching("*" + queue + "*")
	opt := asynq.RedisClientOpt{Addr: b.addr}
	// asynq v0.26's count of the queue's tasks done (internal/base's
	// ProcessedTotalKey); a task sent back to wait for its turn is no
	// failure to sluice, so it is not counted.
	processed := "asynq:{" + queue + "}:processed"
	return fleetDrain(ctx, b, "sluice",
		func() error { return enqueueEach(opt, queue, fleetTasks, newNoop) },
		func() (*exec.Cmd, error) {
			w := exec.CommandContext(ctx, binary, "--config", config)
			w.Env = append(os.Environ(), "SLUICE_WORKER_METRICS_ADDR="+freeLoopback())
			return w, w.Start()
		},
		func() (int, error) {
			n, err := b.rdb.Get(ctx, processed).Int()
			if errors.Is(err, redis.Nil) {
				return 0, nil
			}
			return n, err
		})
}

// bullMQHarness makes scripts/bullmq ready to run, installing its
// package-lock.json's packages if they are not there yet, and returns its
// directory, or why BullMQ cannot run here.
func bullMQHarness(ctx context.Context, b *bench) (dir, skipped string) {
	for _, tool := range []string{"node", "npm"} {
		if _, err := exec.LookPath(tool); err != nil {
			return "", tool + " is not on PATH"
		}
	}
	gomod, err := exec.CommandContext(ctx, "go", "env", "GOMOD").Output()
	if err != nil || strings.TrimSpace(string(gomod)) == "" || strings.TrimSpace(string(gomod)) == os.DevNull {
		return "", "scripts/bullmq not found: the bench runs outside sluice's module"
	}
	dir = filepath.Join(filepath.Dir(strings.TrimSpace(string(gomod))), "scripts", "bullmq")
	if _, err := os.Stat(filepath.Join(dir, "node_modules")); err == nil {
		return dir, ""
	}
	install := []string{"ci"}
	if _, err := os.Stat(filepath.Join(dir, "package-lock.json")); err != nil {
		install = []string{"install"}
	}
	b.progress("fleet: npm %s in %s", install[0], dir)
	npm := exec.CommandContext(ctx, "npm", append(install, "--no-audit", "--no-fund")...)
	npm.Dir = dir
	if out, err := npm.CombinedOutput(); err != nil {
		return "", fmt.Sprintf("npm %s in %s failed: %v: %s", install[0], dir, err, strings.TrimSpace(string(out)))
	}
	return dir, ""
}

// bullMQFleet drains fleetTasks jobs with scripts/bullmq in dir.
func bullMQFleet(ctx context.Context, b *bench, dir, queue string) (fleetRun, error) {
	defer b.deleteMatching("bull:" + queue + ":*")
	node := func(args ...string) *exec.Cmd {
		cmd := exec.CommandContext(ctx, "node", args...)
		cmd.Dir = dir
		cmd.Env = append(os.Environ(), "REDIS_URL=redis://"+b.addr)
		return cmd
	}
	completed := "bull:" + queue + ":completed"
	return fleetDrain(ctx, b, bullMQ,
		func() error {
			if out, err := node("produce.js", queue, fmt.Sprint(fleetTasks)).CombinedOutput(); err != nil {
				return fmt.Errorf("node produce.js: %w: %s", err, out)
			}
			return nil
		},
		func() (*exec.Cmd, error) {
			w := node("work.js", queue)
			w.Stderr = os.Stderr // its errors, which would otherwise only show as a drain that never ends
			return w, w.Start()
		},
		func() (int, error) {
			n, err := b.rdb.ZCard(ctx, completed).Result()
			return int(n), err
		})
}
