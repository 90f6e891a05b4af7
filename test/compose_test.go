package test

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/sluicehq/sluice/internal/redistest"
	"github.com/sluicehq/sluice/internal/testkit"
)

// TestGatesCombined: a queue drained through a leaky bucket whose tasks also
// draw on a token-bucket quota delivers the tighter of the two, on one
// worker and on three, on the standalone server and on the cluster (where
// the drain and the quota keys are in different slots): the drain's rate
// within 2% when the quota does not bind; when it binds, the quota used at
// 95% or more and never above burst + rate·T. Half the tasks have MaxRetry
// 0; none is lost, run twice, failed or left behind.
func TestGatesCombined(t *testing.T) {
	t.Parallel()
	for _, b := range backends {
		t.Run(b.name, func(t *testing.T) {
			t.Parallel()
			for _, workers := range []int{1, 3} {
				t.Run(fmt.Sprintf("%d workers, quota far above the drain", workers), func(t *testing.T) {
					t.Parallel()
					testDrainBinds(t, b, workers, "limit: 400, period: 1s, burst: 40")
				})
				t.Run(fmt.Sprintf("%d workers, quota never binding", workers), func(t *testing.T) {
					t.Parallel()
					testDrainBinds(t, b, workers, "limit: 100000, period: 1s, burst: 100000")
				})
				t.Run(fmt.Sprintf("%d workers, quota binds", workers), func(t *testing.T) {
					t.Parallel()
					testQuotaBinds(t, b, workers)
				})
			}
		})
	}
}

// testDrainBinds: drain 25/s burst 1 and a quota of spec far above it: 250
// tasks at 25/s within 2%, no second with more than 26.
func testDrainBinds(t *testing.T, b backend, workers int, quotaSpec string) {
	const tasks = 250
	queue, quota := redistest.Queue(t, "q"), redistest.Queue(t, "api")
	r := startFleet(t, b, workers, fmt.Sprintf(`
worker: {concurrency: 10}
queues:
  %s: {drain: {algorithm: leaky_bucket, limit: 25, period: 1s, burst: 1}}
quotas:
  %s: {algorithm: token_bucket, %s}
tasks:
  http:request: {quotas: [%s]}
`, queue, quota, quotaSpec, quota))
	r.enqueue(t, queue, "r", tasks)
	arrivals := r.finish(t, tasks, 40*time.Second, queue)
	// A second less the arrival tolerance: a call that reached the upstream
	// late (a new connection) is not an event over the drain.
	got, most := rate(arrivals), testkit.MaxInWindow(arrivals, time.Second-within)
	t.Logf("%d requests at %.3f/s, at most %d in a second; %s", len(arrivals), got, most, r.costs(t, tasks))
	if got < 24.5 || got > 25.5 {
		t.Errorf("drained at %.3f/s, want 25/s within 2%%", got)
	}
	if most > 26 {
		t.Errorf("%d requests within one second (less %v), want at most 26: %s", most, within, densest(arrivals, time.Second-within))
	}
}

// testQuotaBinds: drain 25/s burst 1 and a quota of 10/s burst 5: 150 tasks,
// the quota used at 95% or more and never above 5 + 10·T.
func testQuotaBinds(t *testing.T, b backend, workers int) {
	const tasks = 150
	queue, quota := redistest.Queue(t, "q"), redistest.Queue(t, "api")
	r := startFleet(t, b, workers, fmt.Sprintf(`
worker: {concurrency: 10}
queues:
  %s: {drain: {algorithm: leaky_bucket, limit: 25, period: 1s, burst: 1}}
quotas:
  %s: {algorithm: token_bucket, limit: 10, period: 1s, burst: 5}
tasks:
  http:request: {quotas: [%s]}
`, queue, quota, quota))
	r.enqueue(t, queue, "r", tasks)
	arrivals := r.finish(t, tasks, 40*time.Second, queue)
	over, used := overAllowance(arrivals, 5, 10), quotaUse(arrivals, 5, 10)
	t.Logf("%d requests at %.3f/s: %.1f%% of the quota used, at most %.2f over 5 + 10·T; %s", len(arrivals), rate(arrivals), 100*used, over, r.costs(t, tasks))
	if over > 0 {
		t.Errorf("some interval saw %.2f requests over 5 + 10·T", over)
	}
	if used < 0.95 {
		t.Errorf("quota used at %.1f%%, want at least 95%%", 100*used)
	}
}

// TestSharedQuotaDrains: three queues drained at 5, 10 and 20/s whose tasks
// share one quota. Above their sum (40/s), each queue drains at its own
// rate within 2%: a slow queue's turns booked far ahead do not hold the
// fast ones back. Below it (20/s, burst 5), the quota is used at 95% or
// more while all are backlogged, never above 5 + 20·T, and no queue beats
// its own drain.
func TestSharedQuotaDrains(t *testing.T) {
	t.Parallel()
	rates := []int{5, 10, 20}
	for _, b := range backends {
		t.Run(b.name, func(t *testing.T) {
			t.Parallel()
			t.Run("quota above the drains", func(t *testing.T) {
				t.Parallel()
				r, queues := startSharedQuota(t, b, rates, "limit: 40, period: 1s, burst: 10")
				total, counts := 0, make([]int, len(rates))
				for i, perSecond := range rates {
					counts[i] = 10 * perSecond // 10 s of work in every queue
					total += counts[i]
				}
				r.enqueueBacklogs(t, queues, counts)
				r.finish(t, total, 40*time.Second, queues...)
				for i, q := range queues {
					got := rate(r.u.Under(q))
					t.Logf("queue drained at %d/s: %.3f/s", rates[i], got)
					if want := float64(rates[i]); got < 0.98*want || got > 1.02*want {
						t.Errorf("queue of drain %d/s ran at %.3f/s, want within 2%%", rates[i], got)
					}
				}
			})
			t.Run("quota below the drains", func(t *testing.T) {
				t.Parallel()
				r, queues := startSharedQuota(t, b, rates, "limit: 20, period: 1s, burst: 5")
				total, counts := 0, make([]int, len(rates))
				for i, perSecond := range rates {
					counts[i] = 12 * perSecond // more than the quota can take in 10 s
					total += counts[i]
				}
				r.enqueueBacklogs(t, queues, counts)
				arrivals := r.finish(t, total, 60*time.Second, queues...)
				over := overAllowance(arrivals, 5, 20)
				// While every queue still has work: up to the first queue's last task.
				end := arrivals[len(arrivals)-1]
				for _, q := range queues {
					own := r.u.Under(q)
					if last := own[len(own)-1]; last.Before(end) {
						end = last
					}
				}
				backlogged := between(arrivals, arrivals[0], end)
				used := quotaUse(backlogged, 5, 20)
				t.Logf("%d requests, %.1f%% of the quota used while all queues were backlogged (%d requests), at most %.2f over 5 + 20·T",
					len(arrivals), 100*used, len(backlogged), over)
				if over > 0 {
					t.Errorf("some interval saw %.2f requests over 5 + 20·T", over)
				}
				if used < 0.95 {
					t.Errorf("quota used at %.1f%% while every queue was backlogged, want at least 95%%", 100*used)
				}
				for i, q := range queues {
					if got := rate(between(r.u.Under(q), arrivals[0], end)); got > 1.02*float64(rates[i]) {
						t.Errorf("queue of drain %d/s ran at %.3f/s, above its drain", rates[i], got)
					}
				}
			})
		})
	}
}

func startSharedQuota(t *testing.T, b backend, rates []int, quotaSpec string) (*fleetRun, []string) {
	t.Helper()
	quota := redistest.Queue(t, "api")
	var queues []string
	var yaml strings.Builder
	for i, perSecond := range rates {
		q := redistest.Queue(t, fmt.Sprintf("q%d", i))
		queues = append(queues, q)
		fmt.Fprintf(&yaml, "  %s: {drain: {limit: %d, period: 1s, burst: 1}}\n", q, perSecond)
	}
	r := startFleet(t, b, 3, fmt.Sprintf(`
worker: {concurrency: 10}
queues:
%squotas:
  %s: {algorithm: token_bucket, %s}
tasks:
  http:request: {quotas: [%s]}
`, yaml.String(), quota, quotaSpec, quota))
	return r, queues
}

// TestGatesLiveChange: three workers at drain 5/s and quota 4/s burst 4
// (the quota binds); both raised in the file to drain 25/s and quota 400/s
// burst 40: 25/s within 2% from 1 s after the change.
func TestGatesLiveChange(t *testing.T) {
	t.Parallel()
	queue, quota := redistest.Queue(t, "q"), redistest.Queue(t, "api")
	r := &fleetRun{backend: backends[0], u: newUpstream(t)}
	config := func(drain int, quotaSpec string) string {
		return fmt.Sprintf(`%s
worker: {concurrency: 10}
queues:
  %s: {drain: {limit: %d, period: 1s, burst: 1}}
quotas:
  %s: {algorithm: token_bucket, %s}
tasks:
  http:request: {quotas: [%s]}
`, backends[0].yaml(t), queue, drain, quota, quotaSpec, quota) + r.u.allowYAML()
	}
	const tasks = 220
	path := writeConfig(t, config(5, "limit: 4, period: 1s, burst: 4"))
	for range 3 {
		r.fleet = append(r.fleet, startWorker(t, path))
	}
	r.enqueue(t, queue, "r", tasks)
	time.Sleep(3 * time.Second)
	changed := time.Now()
	replace(t, path, config(25, "limit: 400, period: 1s, burst: 40"))
	arrivals := r.finish(t, tasks, 40*time.Second, queue)
	before := between(arrivals, arrivals[0], changed)
	after := between(arrivals, changed.Add(time.Second), arrivals[len(arrivals)-1].Add(time.Nanosecond))
	t.Logf("%.2f/s before the change (%d requests), %.3f/s from 1 s after it (%d requests)", rate(before), len(before), rate(after), len(after))
	if over := overAllowance(before, 4, 4); over > 0 {
		t.Errorf("before the change some interval saw %.2f requests over 4 + 4·T", over)
	}
	if got := rate(after); got < 24.5 || got > 25.5 {
		t.Errorf("%.3f/s from 1 s after the change, want 25/s within 2%%", got)
	}
}
