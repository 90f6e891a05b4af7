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
// are done or ctx ends. It counts tasks by what is left in each queue, so
// it assumes the queues were empty.
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
	// The clock starts with the first task enqueued: the worker drains
	// while the rest are enqueued.
	start := time.Now()
	for _, q := range queues {
		for i := 0; i < n; i++ {
			task, _ := jobs.NewNoopTask()
			if _, err := client.EnqueueContext(ctx, task, asynq.Queue(q)); err != nil {
				log.Error("demo: cannot enqueue", "queue", q, "err", err)
				return
			}
		}
	}
	fmt.Fprintf(out, "demo: enqueued %d demo:noop tasks into each of %s in %.1fs\n", n, strings.Join(queues, ", "), time.Since(start).Seconds())

	// The rate shown is over the last few seconds while a queue has work,
	// and over its whole run once it is done.
	const window = 3 * time.Second
	history := map[string][]progress{} // queue -> done, second by second, from {start, 0}
	finished := map[string]time.Duration{}
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		var line strings.Builder
		for _, q := range queues {
			info, err := inspector.GetQueueInfo(q)
			if err != nil {
				continue
			}
			now := progress{at: time.Since(start), done: n - info.Pending - info.Scheduled - info.Active - info.Retry}
			if history[q] == nil {
				history[q] = []progress{{}}
			}
			history[q] = append(history[q], now)
			rate := rateOver(history[q], window)
			if _, ok := finished[q]; !ok && now.done >= n {
				finished[q] = now.at
			}
			if took, ok := finished[q]; ok {
				rate = float64(n) / took.Seconds()
			}
			drain := "no drain"
			if d := cfg.Queues[q].Drain; d != nil {
				drain = fmt.Sprintf("drain %d per %v", d.Limit, d.Period)
			}
			fmt.Fprintf(&line, "  %s %d/%d %.1f/s (%s)", q, now.done, n, rate, drain)
		}
		fmt.Fprintf(out, "demo %3.0fs:%s\n", time.Since(start).Seconds(), line.String())
		if len(finished) == len(queues) {
			fmt.Fprintf(out, "demo: all done in %.1fs; the worker keeps running (Ctrl-C to stop)\n", time.Since(start).Seconds())
			return
		}
	}
}

// progress is how many of a queue's demo tasks were done at a time since
// the demo started.
type progress struct {
	at   time.Duration
	done int
}

// rateOver is the rate of the last window of history (at least two
// samples, in order): from the latest sample at least window before the
// last one, or from the first.
func rateOver(history []progress, window time.Duration) float64 {
	last := history[len(history)-1]
	from := history[0]
	for _, p := range history {
		if last.at-p.at < window {
			break
		}
		from = p
	}
	if last.at <= from.at {
		return 0
	}
	return float64(last.done-from.done) / (last.at - from.at).Seconds()
}
