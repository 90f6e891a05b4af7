package main

import (
	"context"
	"fmt"
	"os"
	"time"

	"github.com/sluicehq/sluice/internal/hiddenlimit"
)

// adaptivePhases are issue 23's: an API whose hidden limit goes 50/s,
// 20/s, 50/s, 30 s each.
var adaptivePhases = []hiddenlimit.Phase{{Limit: 50, For: 30 * time.Second}, {Limit: 20, For: 30 * time.Second}, {Limit: 50, For: 30 * time.Second}}

// adaptiveSettle: a phase is judged after its first 10 s.
const adaptiveSettle = 10 * time.Second

// runAdaptive drains a backlog of http:request tasks with 3 worker
// processes through one quota against the stand-in API
// (internal/hiddenlimit, the harness of test/adaptive_test.go): the quota
// adaptive (min 5, max 100, start 30), then static at 50 and at 20.
func runAdaptive(ctx context.Context, b *bench) error {
	dir, binary, err := buildWorker(ctx, b, "adaptive")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	quotas := []struct{ name, yaml string }{
		{"adaptive, min 5, max 100, start 30", "{algorithm: leaky_bucket, limit: 30, period: 1s, burst: 1, adaptive: {min: 5, max: 100}}"},
		{"static 50/s", "{algorithm: leaky_bucket, limit: 50, period: 1s, burst: 1}"},
		{"static 20/s", "{algorithm: leaky_bucket, limit: 20, period: 1s, burst: 1}"},
	}
	fmt.Fprintf(b.out, `
### adaptive: a quota that learns the upstream's limit

%d worker processes (the real binary, default worker settings) drain %d http:request tasks queued up front through one quota (leaky_bucket, burst 1) against a stand-in API whose hidden limit is its own token bucket (burst a fifth of a second of its rate; 429 with Retry-After: 1 beyond it), %d/s, then %d/s, then %d/s, %v each: the harness of test/adaptive_test.go (internal/hiddenlimit). Successes a second per phase, over the whole phase and after its first %v; 429s per phase; "the drop's 429 burst" is how long the 429s that began with the drop to %d/s went on, until a second without one (a static quota's 429s come back after each second's pause: count them in the phase's column). Redis commands and script runs a second: INFO commandstats over the whole run, everything the fleet did (asynq's own polling included), the cost to compare between rows.

| quota | phase 1: %d/s | phase 2: %d/s | phase 3: %d/s | calls | 429s | the drop's 429 burst | Redis commands/s | script runs/s |
|---|--:|--:|--:|--:|--:|--:|--:|--:|
`, 3, adaptiveTasks, adaptivePhases[0].Limit, adaptivePhases[1].Limit, adaptivePhases[2].Limit, adaptivePhases[0].For, adaptiveSettle, adaptivePhases[1].Limit,
		adaptivePhases[0].Limit, adaptivePhases[1].Limit, adaptivePhases[2].Limit)
	for i, q := range quotas {
		b.progress("adaptive: %s", q.name)
		api := hiddenlimit.NewAPI(adaptivePhases, false)
		fleet := hiddenlimit.Fleet{Worker: binary, Redis: b.addr, Dir: dir, Queue: fmt.Sprintf("%s-adaptive-%d", b.runID, i), Quota: q.yaml, Workers: 3, Tasks: adaptiveTasks}
		before, err := commandsRun(ctx, b.rdb)
		if err != nil {
			return err
		}
		started := time.Now()
		res, err := fleet.Run(ctx, api, adaptivePhases)
		var after commandCount
		if err == nil {
			after, err = commandsRun(ctx, b.rdb)
		}
		took := time.Since(started).Seconds()
		api.Close()
		b.deleteMatching("*" + fleet.Queue + "*")
		if err != nil {
			return fmt.Errorf("%s: %w", q.name, err)
		}
		row := "| " + q.name
		calls, busy := 0, 0
		for _, s := range hiddenlimit.Stats(res.Calls, adaptivePhases, adaptiveSettle) {
			row += fmt.Sprintf(" | %.1f/s, %.1f/s after %v (%.0f%%); %d 429s", s.OKPerSecond, s.Settled, adaptiveSettle, 100*s.SettledShare, s.Busy)
			calls += s.Calls
			busy += s.Busy
		}
		fmt.Fprintf(b.out, "%s | %d | %d (%.1f%%) | %.1f s | %s | %.0f |\n", row, calls, busy, 100*float64(busy)/float64(calls), hiddenlimit.BusyEnd(res.Calls, adaptivePhases[0].For).Seconds(),
			grouped(float64(after.all-before.all)/took), float64(after.scripts-before.scripts)/took)
	}
	return nil
}

// adaptiveTasks is the backlog: more than the fleet can do in the run.
const adaptiveTasks = 7_000
