package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"sort"
	"strings"
	"time"

	"github.com/hibiken/asynq"

	"github.com/sluicehq/sluice/jobs"
)

// runDemo enqueues n demo:noop tasks into every configured queue, then
// prints each queue's progress and measured rate every second until all
// are done or ctx ends.
func runDemo(ctx context.Context, redisOpt asynq.RedisConnOpt, cfg jobs.Config, n int, out io.Writer, log *slog.Logger) {
	client := asynq.NewClient(redisOpt)
	defer client.Close()
	inspector := asynq.NewInspector(redisOpt)
	defer inspector.Close()
	queues := make([]string, 0, len(cfg.Queues))
	for q := range cfg.Queues {
		queues = append(queues, q)
	}
	sort.Strings(queues)
	for _, q := range queues {
		for i := 0; i < n; i++ {
			task, _ := jobs.NewNoopTask()
			if _, err := client.EnqueueContext(ctx, task, asynq.Queue(q)); err != nil {
				log.Error("demo: cannot enqueue", "queue", q, "err", err)
				return
			}
		}
	}
	fmt.Fprintf(out, "demo: enqueued %d demo:noop tasks into each of %s\n", n, strings.Join(queues, ", "))

	start := time.Now()
	first := map[string]time.Time{}
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		all := true
		var line strings.Builder
		for _, q := range queues {
			info, err := inspector.GetQueueInfo(q)
			if err != nil {
				continue
			}
			done := n - info.Pending - info.Scheduled - info.Active - info.Retry
			if done > 0 && first[q].IsZero() {
				first[q] = time.Now()
			}
			rate := 0.0
			if !first[q].IsZero() {
				rate = float64(done) / time.Since(start).Seconds()
			}
			drain := "no drain"
			if d := cfg.Queues[q].Drain; d != nil {
				drain = fmt.Sprintf("drain %d per %v", d.Limit, d.Period)
			}
			fmt.Fprintf(&line, "  %-10s %4d/%d done  %6.2f/s  (%s)", q, done, n, rate, drain)
			if done < n {
				all = false
			}
		}
		fmt.Fprintf(out, "demo %5.1fs:%s\n", time.Since(start).Seconds(), line.String())
		if all {
			fmt.Fprintf(out, "demo: all done in %.1fs; the worker keeps running (Ctrl-C to stop)\n", time.Since(start).Seconds())
			return
		}
	}
}
