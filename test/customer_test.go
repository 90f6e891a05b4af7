package test

import (
	"encoding/json"
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
)

// crm stands in for a CRM that allows each customer token 5 requests in
// any sliding second, and answers 429 with Retry-After: 1 beyond: as the
// upstream sees it, by the arrivals of the requests it accepted.
type crm struct {
	*httptest.Server
	accepted testkit.Timeline // accepted requests by path /sync/<customer>/<record>
	mu       sync.Mutex
	byToken  map[string][]time.Time // accepted arrivals per token
	refused  int                    // 429s
	first429 string                 // the accepted arrivals of the token the first 429 was for, in its second
	closest  time.Duration          // the shortest span of 6 arrivals of a token (accepted or not)
	arrivals map[string][]time.Time // every arrival per token
}

const crmLimit, crmPeriod = 5, time.Second

func newCRM(t *testing.T) *crm { return startCRM(t, crmLimit) }

// newCRMUnlimited is a crm that refuses nothing.
func newCRMUnlimited(t *testing.T) *crm { return startCRM(t, 1<<30) }

// startCRM starts a crm that allows limit requests per token in any
// sliding second.
func startCRM(t *testing.T, limit int) *crm {
	c := &crm{byToken: map[string][]time.Time{}, arrivals: map[string][]time.Time{}, closest: time.Hour}
	c.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		now := time.Now()
		token := strings.TrimPrefix(r.Header.Get("Authorization"), "Bearer ")
		c.mu.Lock()
		all := append(c.arrivals[token], now)
		c.arrivals[token] = all
		if len(all) > crmLimit {
			c.closest = min(c.closest, now.Sub(all[len(all)-crmLimit-1]))
		}
		seen := c.byToken[token]
		if len(seen) >= limit && now.Sub(seen[len(seen)-limit]) < crmPeriod {
			if c.refused == 0 {
				var gaps []string
				for _, at := range seen[len(seen)-limit:] {
					gaps = append(gaps, now.Sub(at).Round(time.Millisecond).String())
				}
				c.first429 = fmt.Sprintf("token %s, accepted %s before", token, strings.Join(gaps, ", "))
			}
			c.refused++
			c.mu.Unlock()
			w.Header().Set("Retry-After", "1")
			w.WriteHeader(http.StatusTooManyRequests)
			return
		}
		c.byToken[token] = append(seen, now)
		c.mu.Unlock()
		c.accepted.Note(r.URL.Path)
		w.WriteHeader(http.StatusOK)
	}))
	t.Cleanup(c.Close)
	return c
}

// TestCustomerQuota (issue 20.1, 20.2): the guide's case of a per-customer
// API quota. A CRM allows each customer token 5 requests in any sliding
// second (429 + Retry-After beyond); two workers built on package worker
// (test/customerworker) sync records through it from one queue drained at
// 20/s, with the config the guide (docs/per-customer-quotas.md) gives for
// "5 per token in any sliding second". 300 tasks of a big customer, then 10 each of 5 small
// ones. With fair shares by customer and without, it asserts: 0 429s; the
// big customer at 4.5/s or more over its run (90% of its quota) as the
// CRM's arrivals show; each small customer's last record accepted within
// 6 s of its enqueue; every record accepted once and nothing left in the
// queue. Before the fix: fair shares on, the big customer got about 2.2/s,
// and an exact sliding_log drew 429s from the arrivals' jitter. About 70 s,
// both side by side.
func TestCustomerQuota(t *testing.T) {
	t.Parallel()
	for _, fair := range []bool{true, false} {
		name := "fair shares off"
		if fair {
			name = "fair shares on"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			runCustomerQuota(t, fair)
		})
	}
}

// customerConfig is the config of the guide "Per-customer API quotas,
// start to finish" (docs/per-customer-quotas.md), as it is, on redis (backend.yaml) with queue and quota
// named for the test, and without its fairness line unless fair.
func customerConfig(t *testing.T, redis, queue, quota string, fair bool) string {
	t.Helper()
	config := docSnippet(t, "docs/per-customer-quotas.md", "# Per-customer API quotas, start to finish", "yaml")
	var lines []string
	for _, line := range strings.Split(config, "\n") {
		switch {
		case strings.HasPrefix(line, "redis:"):
			line = strings.TrimSpace(redis)
		case strings.Contains(line, "fairness:") && !fair:
			continue
		}
		lines = append(lines, line)
	}
	config = strings.Join(lines, "\n")
	for from, to := range map[string]string{"\n  crm:\n": "\n  " + queue + ":\n", "\n  crm-api:": "\n  " + quota + ":", "[crm-api]": "[" + quota + "]"} {
		if !strings.Contains(config, from) {
			t.Fatalf("the guide's config has no %q:\n%s", from, config)
		}
		config = strings.Replace(config, from, to, 1)
	}
	return config
}

func runCustomerQuota(t *testing.T, fair bool) {
	const big, small, each = 300, 5, 10
	queue, quota := redistest.Queue(t, "crm"), redistest.Queue(t, "per-token")
	c := newCRM(t)
	path := writeConfig(t, customerConfig(t, backends[0].yaml(t), queue, quota, fair))
	for range 2 {
		startWorkerBinary(t, "test/customerworker", []string{"--config", path, "--crm", c.URL})
	}
	client := asynq.NewClient(backends[0].asynqOpt(t))
	defer client.Close()
	enqueue := func(customer string, n int) time.Time {
		for i := range n {
			payload, _ := json.Marshal(map[string]string{"customer": customer, "token": "tok-" + customer, "record": fmt.Sprint(i)})
			if _, err := client.Enqueue(asynq.NewTask("crm:sync", payload), asynq.Queue(queue)); err != nil {
				t.Fatal(err)
			}
		}
		return time.Now()
	}
	start := time.Now()
	enqueue("big", big)
	enqueued := make([]time.Time, small)
	for i := range small {
		enqueued[i] = enqueue(fmt.Sprint("small", i), each)
	}
	total := big + small*each
	// 300 at 5/s is a minute; twice that before giving up, and the figures
	// of what came either way.
	deadline := start.Add(2 * time.Minute)
	for len(c.accepted.All()) < total && time.Now().Before(deadline) {
		time.Sleep(100 * time.Millisecond)
	}
	time.Sleep(300 * time.Millisecond) // duplicates would show
	bigs := c.accepted.Matching(func(p string) bool { return strings.HasPrefix(p, "/sync/big/") })
	c.mu.Lock()
	refused, closest, first429 := c.refused, c.closest, c.first429
	c.mu.Unlock()
	if refused > 0 {
		t.Logf("the first 429: %s", first429)
	}
	bigRate := rate(bigs)
	t.Logf("big customer: %d records at %.2f/s over %v; %d 429s; 6 arrivals of a token spanned at least %v",
		len(bigs), bigRate, spanOf(bigs).Round(time.Millisecond), refused, closest.Round(time.Millisecond))
	for i := range small {
		own := c.accepted.Matching(func(p string) bool { return strings.HasPrefix(p, fmt.Sprintf("/sync/small%d/", i)) })
		if len(own) != each {
			t.Errorf("small customer %d: %d records accepted, want %d", i, len(own), each)
			continue
		}
		took := own[len(own)-1].Sub(enqueued[i])
		t.Logf("small customer %d: done %v after its enqueue", i, took.Round(time.Millisecond))
		if took > 6*time.Second {
			t.Errorf("small customer %d's last record accepted %v after its enqueue, want within 6s", i, took.Round(time.Millisecond))
		}
	}
	if refused > 0 {
		t.Errorf("the CRM answered %d 429s, want 0", refused)
	}
	if bigRate < 4.5 {
		t.Errorf("big customer at %.2f/s over its run, want at least 4.5/s (90%% of its quota of 5/s)", bigRate)
	}
	if got, distinct := len(c.accepted.All()), c.accepted.Distinct(); got != total || distinct != total {
		t.Errorf("%d records accepted, %d distinct, want %d of %d: tasks lost or run twice", got, distinct, total, total)
	}
	backends[0].checkQueueEmpty(t, queue)
}

// spanOf is the time from the first of times to the last.
func spanOf(times []time.Time) time.Duration {
	if len(times) < 2 {
		return 0
	}
	return times[len(times)-1].Sub(times[0])
}

// TestFairDrainDelivered (issue 20.1): fair shares alone deliver the drain
// at any rate. Two workers (test/customerworker) on a queue drained at
// 5/s and at 100/s (leaky bucket, burst 1) with fair shares by customer,
// no quota, the queue backlogged with 1 customer and with 6: as the CRM
// sees them, the requests come at the drain's rate within 2%, from the
// first to the last. About 20 s, side by side. Users measured 4.21/s (84%)
// for a customer alone at 5/s, which held one turn ahead, its next task
// coming through its line only after that turn had passed; on this
// machine the old code delivered 5.00/s and 4.92/s at 5/s too (and 100/s),
// so this test guards the lead that fixes it rather than showing the bug.
func TestFairDrainDelivered(t *testing.T) {
	t.Parallel()
	for _, c := range []struct{ perSecond, keys, tasks int }{{5, 1, 100}, {5, 6, 100}, {100, 1, 1000}, {100, 6, 1000}} {
		t.Run(fmt.Sprintf("%d per second, %d customers", c.perSecond, c.keys), func(t *testing.T) {
			t.Parallel()
			queue := redistest.Queue(t, "fair")
			crm := newCRMUnlimited(t)
			path := writeConfig(t, fmt.Sprintf(`%s
queues:
  %s:
    drain: {algorithm: leaky_bucket, limit: %d, period: 1s, burst: 1}
    fairness: {key: payload.customer}
`, backends[0].yaml(t), queue, c.perSecond))
			for range 2 {
				startWorkerBinary(t, "test/customerworker", []string{"--config", path, "--crm", crm.URL})
			}
			inspector := asynq.NewInspector(backends[0].asynqOpt(t))
			defer inspector.Close()
			if err := inspector.PauseQueue(queue); err != nil {
				t.Fatal(err)
			}
			client := asynq.NewClient(backends[0].asynqOpt(t))
			defer client.Close()
			for i := range c.tasks {
				customer := fmt.Sprint("c", i%c.keys)
				payload, _ := json.Marshal(map[string]string{"customer": customer, "token": customer, "record": fmt.Sprint(i)})
				if _, err := client.Enqueue(asynq.NewTask("crm:sync", payload), asynq.Queue(queue)); err != nil {
					t.Fatal(err)
				}
			}
			if err := inspector.UnpauseQueue(queue); err != nil {
				t.Fatal(err)
			}
			testkit.WaitFor(t, time.Duration(3*c.tasks/c.perSecond)*time.Second, fmt.Sprintf("%d requests", c.tasks), func() bool { return len(crm.accepted.All()) >= c.tasks })
			arrivals := crm.accepted.All()
			got := rate(arrivals)
			t.Logf("%d requests of %d customers at %.2f/s (drain %d/s)", len(arrivals), c.keys, got, c.perSecond)
			if got < 0.98*float64(c.perSecond) || got > 1.02*float64(c.perSecond) {
				t.Errorf("%d customers drained at %.2f/s, want %d/s within 2%%", c.keys, got, c.perSecond)
			}
		})
	}
}
