package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"syscall"
	"time"

	"github.com/hibiken/asynq"

	"github.com/sluicehq/sluice/jobs"
)

// pageTasks is how many demo:noop tasks each page measurement drains.
const pageTasks = 20000

// pageRefresh is how often the limits page's script asks for its figures
// (worker/limits.go's refreshEvery).
const pageRefresh = 1500 * time.Millisecond

// runPage measures what the limits page (/ui/limits) costs a worker that
// drains a queue: the real worker binary drains demo:noop tasks through a
// drain of 2,000/s, and through one far above its load (as fast as it can),
// with nobody looking and with the page open (its HTML once, then its
// figures every 1.5 s, as its script asks for them), in the same rounds.
func runPage(ctx context.Context, b *bench) error {
	dir, binary, err := buildWorker(ctx, b, "page")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	type load struct {
		name  string
		drain string
	}
	loads := []load{
		{"drain 2,000/s", "{algorithm: leaky_bucket, limit: 2000, period: 1s, burst: 1}"},
		{"as fast as it can", "{limit: 1000000, period: 1s, burst: 1000000}"},
	}
	runs := map[string][]pageRun{}
	var measurements []measurement
	for i, l := range loads {
		for _, open := range []bool{false, true} {
			name := pageRowName(l.name, open)
			measurements = append(measurements, measurement{name, func(ctx context.Context) (float64, error) {
				queue := fmt.Sprintf("%s-page-%d-%t-%d", b.runID, i, open, len(runs[name]))
				r, err := drainWithPage(ctx, b, binary, dir, queue, l.drain, open)
				runs[name] = append(runs[name], r)
				return r.rate, err
			}})
		}
	}
	rates, err := eachRound(ctx, b, b.rounds, measurements)
	if err != nil {
		return err
	}
	fmt.Fprintf(b.out, `
### page: what the limits page costs a worker

One worker process (the real binary, built for the run; concurrency 50) drains %s demo:noop tasks, loaded before it starts, through a drain of 2,000/s, then through one far above what it can do; each with nobody looking at /ui/limits and with the page open (its HTML once, then its figures from /ui/limits.json every %v, as its script asks: each refresh reads the gates' limits and levels, the queue's counts and the tasks waiting in its retry and scheduled sets, from Redis, and this worker's counters). Tasks/s: the tasks over the time from the worker's start to the queue's last task done. CPU per task: the worker's (user + system, from its exit) and redis-server's (INFO cpu) over the run. %d rounds, each running every row once (every other round in reverse order); a row's ratio is the median of its rounds' own ratios to the page closed beside it, lowest and highest in brackets.

| worker | tasks/s, median | ratio to the page closed | worker + Redis CPU µs/task, median | CPU ratio to the page closed | page refreshes | refresh, median ms |
|---|--:|--:|--:|--:|--:|--:|
`, grouped(pageTasks), pageRefresh, b.rounds)
	for _, l := range loads {
		closed, open := pageRowName(l.name, false), pageRowName(l.name, true)
		cpuRatios := make([]float64, len(runs[closed]))
		for i := range cpuRatios {
			cpuRatios[i] = runs[open][i].cpuPerTask() / runs[closed][i].cpuPerTask()
		}
		for _, name := range []string{closed, open} {
			cpu := make([]float64, len(runs[name]))
			refreshes, latency := 0, []float64{}
			for i, r := range runs[name] {
				cpu[i] = r.cpuPerTask()
				refreshes += r.refreshes
				latency = append(latency, r.refreshMS...)
			}
			rateRatio, cpuRatio, refreshCell, latencyCell := "1.00", "1.00", "-", "-"
			if name == open {
				rateRatio, cpuRatio = ratioCell(rates, open, closed), ratiosCell(cpuRatios)
				refreshCell, latencyCell = grouped(float64(refreshes)), fmt.Sprintf("%.1f", median(latency))
			}
			fmt.Fprintf(b.out, "| %s | %s | %s | %.0f | %s | %s | %s |\n", name, grouped(median(rates[name])), rateRatio, median(cpu), cpuRatio, refreshCell, latencyCell)
		}
	}
	return nil
}

func pageRowName(load string, open bool) string {
	if open {
		return load + ", page open"
	}
	return load + ", page closed"
}

// ratiosCell is the median of ratios with the lowest and highest in
// brackets, as ratioCell shows them.
func ratiosCell(ratios []float64) string {
	lo, hi := ratios[0], ratios[0]
	for _, r := range ratios {
		lo, hi = min(lo, r), max(hi, r)
	}
	return fmt.Sprintf("%.3f [%.3f, %.3f]", median(ratios), lo, hi)
}

// pageRun is what one drainWithPage saw.
type pageRun struct {
	rate                float64
	workerCPU, redisCPU time.Duration
	refreshes           int
	refreshMS           []float64
}

func (r pageRun) cpuPerTask() float64 {
	return (r.workerCPU + r.redisCPU).Seconds() * 1e6 / pageTasks
}

// drainWithPage loads pageTasks tasks into queue, drains them with one
// worker through drain, with the limits page open or not, and stops the
// worker.
func drainWithPage(ctx context.Context, b *bench, binary, dir, queue, drain string, open bool) (pageRun, error) {
	config := filepath.Join(dir, queue+".yaml")
	yaml := fmt.Sprintf("redis: {addr: %q}\nworker: {concurrency: 50}\nqueues:\n  %s: {drain: %s}\n", b.addr, queue, drain)
	if err := os.WriteFile(config, []byte(yaml), 0o644); err != nil {
		return pageRun{}, err
	}
	opt := asynq.RedisClientOpt{Addr: b.addr}
	inspector := asynq.NewInspector(opt)
	defer inspector.Close()
	defer inspector.DeleteQueue(queue, true)
	if err := enqueueEach(opt, queue, pageTasks, func(int) *asynq.Task {
		task, _ := jobs.NewNoopTask()
		return task
	}); err != nil {
		return pageRun{}, err
	}
	redisBefore, err := redisCPU(ctx, b)
	if err != nil {
		return pageRun{}, err
	}
	addr := freeLoopback()
	w := exec.CommandContext(ctx, binary, "--config", config)
	w.Env = append(os.Environ(), "SLUICE_WORKER_METRICS_ADDR="+addr)
	start := time.Now()
	if err := w.Start(); err != nil {
		return pageRun{}, err
	}
	stopWorker := func() {
		w.Process.Signal(syscall.SIGTERM)
		w.Wait()
	}
	var r pageRun
	viewing, stopViewing := context.WithCancel(ctx)
	var viewer sync.WaitGroup
	if open {
		viewer.Go(func() { r.refreshes, r.refreshMS = viewPage(viewing, "http://"+addr) })
	}
	deadline := start.Add(5 * time.Minute)
	for {
		info, err := inspector.GetQueueInfo(queue)
		if err == nil && info.Pending+info.Active+info.Retry+info.Scheduled == 0 {
			break
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			stopViewing()
			stopWorker()
			return pageRun{}, fmt.Errorf("queue %s not drained after 5 minutes: %+v %v", queue, info, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	elapsed := time.Since(start)
	stopViewing()
	viewer.Wait()
	stopWorker()
	redisAfter, err := redisCPU(ctx, b)
	if err != nil {
		return pageRun{}, err
	}
	r.rate = pageTasks / elapsed.Seconds()
	r.workerCPU = w.ProcessState.UserTime() + w.ProcessState.SystemTime()
	r.redisCPU = redisAfter - redisBefore
	return r, nil
}

// viewPage opens the limits page at base as a browser does with its
// script on: the HTML once, then the figures every pageRefresh, until ctx
// ends. It returns how many refreshes it made and how long each took.
func viewPage(ctx context.Context, base string) (refreshes int, ms []float64) {
	get := func(path string) {
		start := time.Now()
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, base+path, nil)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return // not up yet, or stopping
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode == http.StatusOK && path != "/ui/limits" {
			refreshes++
			ms = append(ms, float64(time.Since(start).Microseconds())/1000)
		}
	}
	get("/ui/limits")
	tick := time.NewTicker(pageRefresh)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return refreshes, ms
		case <-tick.C:
			get("/ui/limits.json")
		}
	}
}
