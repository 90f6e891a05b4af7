package test

import (
	"fmt"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/sluicehq/sluice/internal/redistest"
	"github.com/sluicehq/sluice/jobs"
)

// enqueueKeyed puts n http:request tasks into queue, their paths under
// prefix, each with the headers, every other one with MaxRetry 0.
func (r *fleetRun) enqueueKeyed(t *testing.T, client *asynq.Client, queue, prefix string, n int, headers map[string]string) {
	t.Helper()
	for i := 0; i < n; i++ {
		task, err := jobs.NewHTTPRequestTask(jobs.HTTPRequestPayload{URL: fmt.Sprintf("%s/%s/%d", r.u.URL, prefix, i), Headers: headers})
		if err != nil {
			t.Fatal(err)
		}
		opts := []asynq.Option{asynq.Queue(queue)}
		if i%2 == 0 {
			opts = append(opts, asynq.MaxRetry(0))
		}
		if _, err := client.Enqueue(task, opts...); err != nil {
			t.Fatal(err)
		}
	}
}

// fairCosts reports limiter calls and trips to Redis per task, and fails
// the test if they are above the targets (1.5 and 2.5).
func (r *fleetRun) fairCosts(t *testing.T, tasks int) {
	t.Helper()
	n := float64(tasks)
	calls := r.counter(t, "sluice_bookings_total") / n
	requeues := r.counter(t, "sluice_throttled_tasks_total", `how="requeued"`) / n
	parked := r.counter(t, "sluice_gate_decisions_total", `result="parked"`) / n
	t.Logf("per task: %.2f limiter calls, %.2f trips to Redis (1 + %.2f requeues; %.2f parked in their key's line)", calls, 1+requeues, requeues, parked)
	if calls > 1.5 {
		t.Errorf("%.2f limiter calls per task, want at most 1.5", calls)
	}
	if 1+requeues > 2.5 {
		t.Errorf("%.2f trips to Redis per task, want at most 2.5", 1+requeues)
	}
}

// TestFairNewcomers: a queue drained at 100/s (leaky bucket, burst 1) with
// fair shares by tenant, 3 workers. 3,000 tasks of one tenant, then 2 s
// later 10 tasks each of 10 other tenants: every small tenant's last task
// done within 5 s of its enqueue (first come, first served it would wait
// about 28 s), and the queue at 100/s within 2% while backlogged.
func TestFairNewcomers(t *testing.T) {
	const big, small, each = 3000, 10, 10
	queue := redistest.Queue(t, "fair")
	r := startFleet(t, backends[0], 3, fmt.Sprintf(`
worker: {concurrency: 10}
queues:
  %s:
    drain: {algorithm: leaky_bucket, limit: 100, period: 1s, burst: 1}
    fairness: {key: 'payload.headers["X-Tenant"]'}
`, queue))
	client := asynq.NewClient(r.asynqOpt(t))
	defer client.Close()
	start := time.Now()
	r.enqueueKeyed(t, client, queue, "big", big, map[string]string{"X-Tenant": "big"})
	time.Sleep(time.Until(start.Add(2 * time.Second)))
	enqueued := make([]time.Time, small)
	for i := range small {
		enqueued[i] = time.Now()
		r.enqueueKeyed(t, client, queue, fmt.Sprintf("t%d", i), each, map[string]string{"X-Tenant": fmt.Sprintf("t%d", i)})
	}
	arrivals := r.finish(t, big+small*each, 60*time.Second, queue)
	worst := time.Duration(0)
	for i := range small {
		own := r.u.Under(fmt.Sprintf("t%d", i))
		if len(own) != each {
			t.Fatalf("tenant t%d: %d requests, want %d", i, len(own), each)
		}
		took := own[len(own)-1].Sub(enqueued[i])
		worst = max(worst, took)
		if took > 5*time.Second {
			t.Errorf("tenant t%d's last task done %v after its enqueue, want within 5s", i, took.Round(time.Millisecond))
		}
	}
	got := rate(arrivals)
	t.Logf("%d requests at %.3f/s; the small tenants' last tasks done at most %v after their enqueue", len(arrivals), got, worst.Round(time.Millisecond))
	if got < 98 || got > 102 {
		t.Errorf("drained at %.3f/s, want 100/s within 2%%", got)
	}
	r.fairCosts(t, big+small*each)
}

// TestFairWeights: tenants vip (weight 3) and std (weight 1), 800 tasks
// each enqueued together, drain 40/s: while both are backlogged, vip:std
// completions 3.0 within 10% in every 5 s window.
func TestFairWeights(t *testing.T) {
	const each = 800
	queue := redistest.Queue(t, "fair")
	r := startFleet(t, backends[0], 3, fmt.Sprintf(`
worker: {concurrency: 10}
queues:
  %s:
    drain: {algorithm: leaky_bucket, limit: 40, period: 1s, burst: 1}
    fairness: {key: 'payload.headers["X-Tenant"]', weights: {vip: 3}}
`, queue))
	client := asynq.NewClient(r.asynqOpt(t))
	defer client.Close()
	for i := range each / 100 {
		r.enqueueKeyed(t, client, queue, fmt.Sprintf("vip%d", i), 100, map[string]string{"X-Tenant": "vip"})
		r.enqueueKeyed(t, client, queue, fmt.Sprintf("std%d", i), 100, map[string]string{"X-Tenant": "std"})
	}
	arrivals := r.finish(t, 2*each, 60*time.Second, queue)
	vip := r.u.Matching(func(p string) bool { return len(p) > 4 && p[1:4] == "vip" })
	std := r.u.Matching(func(p string) bool { return len(p) > 4 && p[1:4] == "std" })
	end := vip[len(vip)-1]
	if last := std[len(std)-1]; last.Before(end) {
		end = last
	}
	for from := arrivals[0]; !from.Add(5 * time.Second).After(end); from = from.Add(5 * time.Second) {
		v, s := len(between(vip, from, from.Add(5*time.Second))), len(between(std, from, from.Add(5*time.Second)))
		ratio := float64(v) / float64(max(s, 1))
		t.Logf("window from %v: vip %d, std %d, ratio %.2f", from.Sub(arrivals[0]).Round(time.Second), v, s, ratio)
		if ratio < 2.7 || ratio > 3.3 {
			t.Errorf("vip:std %d:%d = %.2f in the 5 s window from %v, want 3.0 within 10%%", v, s, ratio, from.Sub(arrivals[0]).Round(time.Second))
		}
	}
	t.Logf("%d requests at %.3f/s", len(arrivals), rate(arrivals))
	if got := rate(arrivals); got < 39.2 || got > 40.8 {
		t.Errorf("drained at %.3f/s, want 40/s within 2%%", got)
	}
	r.fairCosts(t, 2*each)
}
