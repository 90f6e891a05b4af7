package test

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/sluicehq/sluice/internal/redistest"
	"github.com/sluicehq/sluice/internal/testkit"
	"github.com/sluicehq/sluice/jobs"
)

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
// fair shares by tenant, 3 workers. 1,500 tasks of one tenant, then 2 s
// later 10 tasks each of 10 other tenants: every small tenant's last task
// done within 5 s of its enqueue (first come, first served it would wait
// about 13 s), and the queue at 100/s within 2% while backlogged (16 s;
// 3,000 tasks took 31 s of 100 requests a second beside the package's
// other timing tests, and showed nothing more).
func TestFairNewcomers(t *testing.T) {
	t.Parallel()
	const big, small, each = 1500, 10, 10
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
	enqueueWithHeaders(t, client, r.u.URL, queue, "big", big, map[string]string{"X-Tenant": "big"})
	time.Sleep(time.Until(start.Add(2 * time.Second)))
	enqueued := make([]time.Time, small)
	for i := range small {
		enqueued[i] = time.Now()
		enqueueWithHeaders(t, client, r.u.URL, queue, fmt.Sprintf("t%d", i), each, map[string]string{"X-Tenant": fmt.Sprintf("t%d", i)})
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
	t.Parallel()
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
		enqueueWithHeaders(t, client, r.u.URL, queue, fmt.Sprintf("vip%d", i), 100, map[string]string{"X-Tenant": "vip"})
		enqueueWithHeaders(t, client, r.u.URL, queue, fmt.Sprintf("std%d", i), 100, map[string]string{"X-Tenant": "std"})
	}
	arrivals := r.finish(t, 2*each, 60*time.Second, queue)
	vip := r.u.Matching(func(p string) bool { return len(p) > 4 && p[1:4] == "vip" })
	std := r.u.Matching(func(p string) bool { return len(p) > 4 && p[1:4] == "std" })
	// Both are backlogged from when both have been served: before that,
	// one tenant had the queue alone (its first tasks were enqueued before
	// the other's, and the other's first task booked behind the turns the
	// first had booked alone, at most the fair horizon of 300ms; the
	// newcomers test covers that wait). Windows counted from the first
	// arrival mixed that lone start into the first window (3.47 once).
	start, end := vip[0], vip[len(vip)-1]
	if std[0].After(start) {
		start = std[0]
	}
	if last := std[len(std)-1]; last.Before(end) {
		end = last
	}
	t.Logf("both served from %v after the first arrival (vip %d, std %d before)", start.Sub(arrivals[0]).Round(time.Millisecond),
		len(between(vip, arrivals[0], start)), len(between(std, arrivals[0], start)))
	for from := start; !from.Add(5 * time.Second).After(end); from = from.Add(5 * time.Second) {
		v, s := len(between(vip, from, from.Add(5*time.Second))), len(between(std, from, from.Add(5*time.Second)))
		ratio := float64(v) / float64(max(s, 1))
		t.Logf("window from %v: vip %d, std %d, ratio %.2f", from.Sub(start).Round(time.Second), v, s, ratio)
		if ratio < 2.7 || ratio > 3.3 {
			t.Errorf("vip:std %d:%d = %.2f in the 5 s window from %v after both were served, want 3.0 within 10%%", v, s, ratio, from.Sub(start).Round(time.Second))
		}
	}
	t.Logf("%d requests at %.3f/s", len(arrivals), rate(arrivals))
	if got := rate(arrivals); got < 39.2 || got > 40.8 {
		t.Errorf("drained at %.3f/s, want 40/s within 2%%", got)
	}
	r.fairCosts(t, 2*each)
}

// TestConcurrencyPerKey: tasks.http:request.concurrency 2 with
// concurrency_key by tenant, 3 worker processes, 2 tenants: never more than
// 2 requests of a tenant at once, and both tenants at 2 at once (the limit
// is per key, not shared).
func TestConcurrencyPerKey(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	running, most := map[string]int{}, map[string]int{}
	total, mostTotal := 0, 0
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tenant := r.Header.Get("X-Tenant")
		mu.Lock()
		running[tenant]++
		total++
		most[tenant], mostTotal = max(most[tenant], running[tenant]), max(mostTotal, total)
		mu.Unlock()
		time.Sleep(150 * time.Millisecond)
		mu.Lock()
		running[tenant]--
		total--
		mu.Unlock()
	}))
	defer srv.Close()
	queue := redistest.Queue(t, "conc")
	path := writeConfig(t, fmt.Sprintf(`redis: {addr: %s}
worker: {concurrency: 10}
queues:
  %s: {}
tasks:
  http:request: {concurrency: 2, concurrency_key: 'payload.headers["X-Tenant"]'}
http: {allow: ['%s']}
`, redistest.Addr(t), queue, srv.Listener.Addr()))
	for range 3 {
		startWorker(t, path)
	}
	client := asynq.NewClient(asynq.RedisClientOpt{Addr: redistest.Addr(t)})
	defer client.Close()
	for i := range 24 {
		tenant := []string{"a", "b"}[i%2]
		task, err := jobs.NewHTTPRequestTask(jobs.HTTPRequestPayload{URL: fmt.Sprintf("%s/%s/%d", srv.URL, tenant, i), Headers: map[string]string{"X-Tenant": tenant}})
		if err != nil {
			t.Fatal(err)
		}
		opts := []asynq.Option{asynq.Queue(queue)}
		if i%4 < 2 {
			opts = append(opts, asynq.MaxRetry(0))
		}
		if _, err := client.Enqueue(task, opts...); err != nil {
			t.Fatal(err)
		}
	}
	inspector := asynq.NewInspector(asynq.RedisClientOpt{Addr: redistest.Addr(t)})
	defer inspector.Close()
	testkit.WaitFor(t, 30*time.Second, "all 24 tasks done", func() bool {
		info, err := inspector.GetQueueInfo(queue)
		return err == nil && info.Size == 0 && info.Processed >= 24
	})
	mu.Lock()
	defer mu.Unlock()
	t.Logf("most at once: tenant a %d, tenant b %d, both %d", most["a"], most["b"], mostTotal)
	if most["a"] > 2 || most["b"] > 2 {
		t.Errorf("a tenant had %d and %d requests at once, want at most 2 each", most["a"], most["b"])
	}
	if mostTotal < 3 {
		t.Errorf("at most %d requests at once in all, want more than 2: the limit is per tenant", mostTotal)
	}
	backends[0].checkQueueEmpty(t, queue)
}

// TestKeyedQuota: 50 destinations × 20 tasks on a quota keyed by
// destination, 4/s burst 4 each, 3 workers: no destination above 4 + 4·T
// in any interval T, all 1,000 done within 7 s (the keys do not serialize
// each other), and 10 s after the last, no per-key state left in Redis.
func TestKeyedQuota(t *testing.T) {
	// Not beside the others: 200 requests a second through 3 workers, judged
	// per destination by the upstream's arrivals, bunched when the machine
	// is busy (0.69 over 4 + 4·T side by side, with gaps of 312 ms then 57 ms).
	const dests, each = 50, 20
	queue, quota := redistest.Queue(t, "keyed"), redistest.Queue(t, "per-dest")
	r := startFleet(t, backends[0], 3, fmt.Sprintf(`
worker: {concurrency: 10}
queues:
  %s: {}
quotas:
  %s: {algorithm: token_bucket, limit: 4, period: 1s, burst: 4, key: 'payload.headers["X-Dest"]'}
tasks:
  http:request: {quotas: [%s]}
`, queue, quota, quota))
	client := asynq.NewClient(r.asynqOpt(t))
	defer client.Close()
	for i := range each {
		for d := range dests {
			task, err := jobs.NewHTTPRequestTask(jobs.HTTPRequestPayload{URL: fmt.Sprintf("%s/d%d/%d", r.u.URL, d, i), Headers: map[string]string{"X-Dest": fmt.Sprint("d", d)}})
			if err != nil {
				t.Fatal(err)
			}
			opts := []asynq.Option{asynq.Queue(queue)}
			if (i+d)%2 == 0 {
				opts = append(opts, asynq.MaxRetry(0))
			}
			if _, err := client.Enqueue(task, opts...); err != nil {
				t.Fatal(err)
			}
		}
	}
	arrivals := r.finish(t, dests*each, 30*time.Second, queue)
	took := arrivals[len(arrivals)-1].Sub(arrivals[0])
	worst, worstDest := 0.0, ""
	for d := range dests {
		// Turns are exact on Redis's clock; arrivals are taken after an
		// HTTP request from one of 3 workers on a shared 2-core machine.
		// One run of 50 keys measured 0.03 over with the 25 ms of the
		// other tests: this one allows 35 ms.
		dest := fmt.Sprint("d", d)
		if over := overAllowanceWithin(r.u.Under(dest), 4, 4, 35*time.Millisecond); over > worst {
			worst, worstDest = over, dest
		}
	}
	t.Logf("%d requests in %v; at most %.2f over 4 + 4·T for any destination; %s", len(arrivals), took.Round(time.Millisecond), worst, r.costs(t, dests*each))
	if worst > 0 {
		t.Errorf("destination %s saw %.2f requests over 4 + 4·T; its densest second: %s", worstDest, worst, densest(r.u.Under(worstDest), time.Second))
	}
	if took > 7*time.Second {
		t.Errorf("all %d done in %v, want within 7s", len(arrivals), took)
	}
	rdb := redistest.Client(t)
	pattern := "sluice:quota:*:k:" + quota + ":*"
	// What each destination throttled in the last minute (for enqueue
	// status --keys) lives a minute by its nature, in one small key per
	// destination that expires: not limiter state, but bounded.
	testkit.WaitFor(t, 15*time.Second, "no per-key limiter state left", func() bool {
		keys, err := rdb.Keys(t.Context(), pattern).Result()
		if err != nil {
			return false
		}
		recent := 0
		for _, k := range keys {
			if strings.HasSuffix(k, ":x") {
				if ttl := rdb.PTTL(t.Context(), k).Val(); ttl <= 0 || ttl > 70*time.Second {
					t.Fatalf("%s has TTL %v, want at most 70s", k, ttl)
				}
				recent++
			}
		}
		if recent > dests {
			t.Fatalf("%d keys of recent throttles, want at most one per destination (%d)", recent, dests)
		}
		return len(keys) == recent
	})
	t.Logf("per-key state gone %v after the last task", time.Since(arrivals[len(arrivals)-1]).Round(100*time.Millisecond))
	if left := time.Since(arrivals[len(arrivals)-1]); left > 10*time.Second+time.Second {
		t.Errorf("per-key state stayed %v after the last task, want gone within 10s", left)
	}
}

// TestFairLiveChange (issue 19.8): two workers drain a fair queue at 20/s,
// backlogged with 300 tasks of one tenant; the file raises the drain to
// 40/s: from 1 s after the change to the last task, 40/s within 5%. (The
// change gave the fair share a new state: the tasks in the old lines came
// back only on asynq's fallback, 15 s with no run, then about 10/s.)
func TestFairLiveChange(t *testing.T) {
	t.Parallel()
	const tasks = 300
	queue := redistest.Queue(t, "fair")
	r := &fleetRun{backend: backends[0], u: newUpstream(t)}
	config := func(drain int) string {
		return fmt.Sprintf(`%s
worker: {concurrency: 10}
queues:
  %s:
    drain: {algorithm: leaky_bucket, limit: %d, period: 1s, burst: 1}
    fairness: {key: 'payload.headers["X-Tenant"]'}
`, backends[0].yaml(t), queue, drain) + r.u.allowYAML()
	}
	path := writeConfig(t, config(20))
	for range 2 {
		r.fleet = append(r.fleet, startWorker(t, path))
	}
	client := asynq.NewClient(r.asynqOpt(t))
	defer client.Close()
	enqueueWithHeaders(t, client, r.u.URL, queue, "a", tasks, map[string]string{"X-Tenant": "a"})
	testkit.WaitFor(t, 20*time.Second, "40 tasks to run at 20/s", func() bool { return len(r.u.All()) >= 40 })
	changed := time.Now()
	replace(t, path, config(40))
	arrivals := r.finish(t, tasks, 40*time.Second, queue)
	after := between(arrivals, changed.Add(time.Second), arrivals[len(arrivals)-1].Add(time.Nanosecond))
	t.Logf("%d requests from 1 s after the change, at %.3f/s", len(after), rate(after))
	if got := rate(after); got < 38 || got > 42 {
		t.Errorf("%.3f/s from 1 s after the drain went from 20/s to 40/s, want 40/s within 5%%", got)
	}
}
