package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
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

// pageHammer is how often the page is refreshed in the row that magnifies
// its cost: 30 times as often as its script does.
const pageHammer = pageRefresh / 30

// runPage measures what the limits page (/ui/limits) costs a worker that
// drains a queue: the real worker binary drains demo:noop tasks through a
// drain of 2,000/s, and through one far above its load (as fast as it can),
// with nobody looking, with the page open (its HTML once, then its figures
// every 1.5 s, as its script asks for them), and with its figures asked
// for 30 times as often, whose extra CPU over the page closed, per
// refresh, is what one refresh costs: a 1% share is too small to see
// beside this machine's drift in a run of its own.
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
	views := []struct {
		name  string
		every time.Duration // 0: nobody looks
	}{{"page closed", 0}, {"page open", pageRefresh}, {fmt.Sprintf("page refreshed every %v", pageHammer), pageHammer}}
	runs := map[string][]pageRun{}
	var measurements []measurement
	for i, l := range loads {
		for j, v := range views {
			name := l.name + ", " + v.name
			measurements = append(measurements, measurement{name, func(ctx context.Context) (float64, error) {
				queue := fmt.Sprintf("%s-page-%d-%d-%d", b.runID, i, j, len(runs[name]))
				r, err := drainWithPage(ctx, b, binary, dir, queue, l.drain, v.every)
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

One worker process (the real binary, built for the run; concurrency 50) drains %s demo:noop tasks, loaded before it starts, through a drain of 2,000/s, then through one far above what it can do; each with nobody looking at /ui/limits, with the page open (its HTML once, then its figures from /ui/limits.json every %v, as its script asks: each refresh reads the gates' limits and levels, the queue's counts and up to 2,000 tasks of its retry and scheduled sets from Redis, and this worker's counters), and with its figures asked for every %v, 30 times as often, to magnify their cost above this machine's drift. Tasks/s: the tasks over the time from the worker's start to the queue's last task done. CPU per task: the worker's (user + system, from its exit) and redis-server's (INFO cpu) over the run. %d rounds, each running every row once (every other round in reverse order); a row's ratios are the medians of its rounds' own ratios to the page closed beside it, lowest and highest in brackets. CPU per refresh: the magnified row's worker + Redis CPU over the closed row's, in the same round, over its refreshes (median of the rounds); the page's share: that CPU for one refresh every %v over the worker + Redis CPU a second of the closed row.

| worker | tasks/s, median | ratio to the page closed | worker + Redis CPU µs/task, median | CPU ratio to the page closed | page refreshes | refresh, median ms |
|---|--:|--:|--:|--:|--:|--:|
`, grouped(pageTasks), pageRefresh, pageHammer, b.rounds, pageRefresh)
	var shares []string
	for _, l := range loads {
		closed := l.name + ", " + views[0].name
		for j, v := range views {
			name := l.name + ", " + v.name
			cpu, cpuRatios, refreshes, latency := []float64{}, []float64{}, 0, []float64{}
			for i, r := range runs[name] {
				cpu = append(cpu, r.cpuPerTask())
				cpuRatios = append(cpuRatios, r.cpuPerTask()/runs[closed][i].cpuPerTask())
				refreshes += r.refreshes
				latency = append(latency, r.refreshMS...)
			}
			if j == 0 {
				fmt.Fprintf(b.out, "| %s | %s | 1.00 | %.0f | 1.00 | - | - |\n", name, grouped(median(rates[name])), median(cpu))
				continue
			}
			fmt.Fprintf(b.out, "| %s | %s | %s | %.0f | %s | %s | %.1f |\n", name, grouped(median(rates[name])), ratioCell(rates, name, closed),
				median(cpu), ratiosCell(cpuRatios), grouped(float64(refreshes)), median(latency))
		}
		var perRefresh, share []float64
		hammered := l.name + ", " + views[2].name
		for i, r := range runs[hammered] {
			base := runs[closed][i]
			extra := (r.workerCPU + r.redisCPU - base.workerCPU - base.redisCPU).Seconds()
			perRefresh = append(perRefresh, extra/float64(max(r.refreshes, 1)))
			share = append(share, extra/float64(max(r.refreshes, 1))/pageRefresh.Seconds()/((base.workerCPU+base.redisCPU).Seconds()/base.elapsed.Seconds()))
		}
		shares = append(shares, fmt.Sprintf("%s: %.1f ms of CPU per refresh, the page's share %.2f%% [%.2f%%, %.2f%%]", l.name,
			1000*median(perRefresh), 100*median(share), 100*slices.Min(share), 100*slices.Max(share)))
	}
	fmt.Fprintf(b.out, "\nThe page open, from the magnified rows: %s.\n", strings.Join(shares, "; "))
	return nil
}

// ratiosCell is the median of ratios with the lowest and highest in
// brackets, as ratioCell shows them.
func ratiosCell(ratios []float64) string {
	return fmt.Sprintf("%.3f [%.3f, %.3f]", median(ratios), slices.Min(ratios), slices.Max(ratios))
}

// pageRun is what one drainWithPage saw.
type pageRun struct {
	rate                float64
	elapsed             time.Duration
	workerCPU, redisCPU time.Duration
	refreshes           int
	refreshMS           []float64
}

func (r pageRun) cpuPerTask() float64 {
	return (r.workerCPU + r.redisCPU).Seconds() * 1e6 / pageTasks
}

// drainWithPage loads pageTasks tasks into queue, drains them with one
// worker through drain, with the limits page refreshed every refresh (0:
// not open), and stops the worker.
func drainWithPage(ctx context.Context, b *bench, binary, dir, queue, drain string, refresh time.Duration) (pageRun, error) {
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
	if refresh > 0 {
		viewer.Go(func() { r.refreshes, r.refreshMS = viewPage(viewing, "http://"+addr, refresh) })
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
	r.rate, r.elapsed = pageTasks/elapsed.Seconds(), elapsed
	r.workerCPU = w.ProcessState.UserTime() + w.ProcessState.SystemTime()
	r.redisCPU = redisAfter - redisBefore
	return r, nil
}

// viewPage opens the limits page at base as a browser does with its
// script on: the HTML once, then the figures every refresh, until ctx
// ends. It returns how many refreshes it made and how long each took.
func viewPage(ctx context.Context, base string, refresh time.Duration) (refreshes int, ms []float64) {
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
	tick := time.NewTicker(refresh)
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
