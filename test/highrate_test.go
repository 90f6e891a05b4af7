package test

import (
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/sluicehq/sluice/internal/redistest"
	"github.com/sluicehq/sluice/internal/testkit"
	"github.com/sluicehq/sluice/jobs"
)

// TestHighRateDrain (12.4): one queue drained at 2,000 tasks/s (leaky
// bucket, burst 1) by 4 worker processes: 24,000 http:request tasks, loaded
// before the workers start; the rate within 2% over the 10 s from one
// second after the first request (in the first, the workers book the
// backlog: each task books its turn as soon as a worker takes it, and most
// go back to Redis to wait for it), no second of the run above 2,040, every
// task done once.
func TestHighRateDrain(t *testing.T) {
	const tasks, perSecond = 24000, 2000
	u := newUpstream(t)
	queue := redistest.Queue(t, "fast")
	config := writeConfig(t, fmt.Sprintf(`
redis: {addr: %s}
worker: {concurrency: 50}
queues:
  %s: {drain: {algorithm: leaky_bucket, limit: %d, period: 1s, burst: 1}}
`, redisAddr(t), queue, perSecond)+u.allowYAML())
	// Backlogged before the first worker starts.
	enqueueMany(t, u, queue, tasks)
	var fleet []*worker
	for range 4 {
		fleet = append(fleet, startWorker(t, config))
	}
	testkit.WaitFor(t, 60*time.Second, "all requests", func() bool { return len(u.All()) >= tasks })
	time.Sleep(500 * time.Millisecond)

	arrivals := u.All()
	span := arrivals[len(arrivals)-1].Sub(arrivals[0])
	from := arrivals[0].Add(time.Second)
	rate := float64(len(between(arrivals, from, from.Add(10*time.Second)))) / 10
	most := testkit.MaxInWindow(arrivals, time.Second)
	var requeued, calls float64
	for _, w := range fleet {
		requeued += w.counter(t, "sluice_throttled_tasks_total", `how="requeued"`)
		calls += w.counter(t, "sluice_bookings_total")
	}
	t.Logf("%d requests in %v (%.1f/s), %.1f/s over the 10 s from one second after the first, at most %d in a second; per task %.3f limiter calls, %.3f trips to Redis",
		len(arrivals), span.Round(time.Millisecond), float64(len(arrivals)-1)/span.Seconds(), rate, most, calls/tasks, requeued/tasks)
	if len(arrivals) != tasks || u.Distinct() != tasks {
		t.Errorf("%d requests for %d distinct tasks, want %d of %d: tasks lost or run twice", len(arrivals), u.Distinct(), tasks, tasks)
	}
	if rate < 0.98*perSecond || rate > 1.02*perSecond {
		t.Errorf("drained at %.1f/s over the 10 s from one second after the first request, want %d/s within 2%%", rate, perSecond)
	}
	if most > perSecond*102/100 {
		t.Errorf("%d requests within one second, want at most %d", most, perSecond*102/100)
	}
}

// enqueueMany puts n http:request tasks for u into queue from 8 clients at
// once, every other one with MaxRetry 0.
func enqueueMany(t *testing.T, u *upstream, queue string, n int) {
	t.Helper()
	client := asynq.NewClient(asynq.RedisClientOpt{Addr: redisAddr(t)})
	defer client.Close()
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for w := range 8 {
		wg.Go(func() {
			for i := w; i < n; i += 8 {
				task, err := jobs.NewHTTPRequestTask(jobs.HTTPRequestPayload{URL: fmt.Sprintf("%s/fast/%d", u.URL, i)})
				if err == nil {
					opts := []asynq.Option{asynq.Queue(queue)}
					if i%2 == 0 {
						opts = append(opts, asynq.MaxRetry(0))
					}
					_, err = client.Enqueue(task, opts...)
				}
				if err != nil {
					errs <- err
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	if err := <-errs; err != nil {
		t.Fatal(err)
	}
}
