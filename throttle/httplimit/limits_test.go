package httplimit

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/internal/redistest"
	"github.com/sluicehq/sluice/throttle"
)

// TestRetryAfter: a client over its limit is answered 429 with Retry-After
// rounded up to whole seconds; one second before that it is still refused,
// and at that time the same request passes. Every answer names the limit
// with the fewest requests left.
func TestRetryAfter(t *testing.T) {
	tests := []struct {
		desc      string
		spec      throttle.Spec
		passes    []time.Duration // offsets of the requests that pass
		refusedAt time.Duration
		retry     int    // Retry-After, s
		policy    string // RateLimit-Policy of per-client
	}{
		{
			desc:   "sliding log: the oldest request ages out",
			spec:   spec(throttle.SlidingLog, 2, time.Minute),
			passes: []time.Duration{0, 10 * time.Second}, refusedAt: 20500 * time.Millisecond,
			retry: 40, policy: `"per-client";q=2;w=60`, // 39.5s, rounded up
		},
		{
			desc:   "fixed window: the window ends",
			spec:   spec(throttle.FixedWindow, 3, time.Minute),
			passes: []time.Duration{0, time.Second, 2 * time.Second}, refusedAt: 59900 * time.Millisecond,
			retry: 1, policy: `"per-client";q=3;w=60`, // 0.1s, at least 1
		},
		{
			desc:   "token bucket: one token refills",
			spec:   throttle.Spec{Algorithm: throttle.TokenBucket, Limit: 1, Period: 10 * time.Second, Burst: 2},
			passes: []time.Duration{0, 0}, refusedAt: 2 * time.Second,
			retry: 8, policy: `"per-client";q=2;w=20`, // two tokens take 20s to refill
		},
	}
	rdb := redistest.Client(t)
	for _, tt := range tests {
		t.Run(tt.desc, func(t *testing.T) {
			f := newFixture(t, rdb, Config{Limits: []Limit{
				{Name: "overall", Key: KeyGlobal, Spec: spec(throttle.SlidingLog, 100, time.Minute)},
				{Name: "per-client", Key: KeyClient, Spec: tt.spec},
			}})
			alice := request{key: "alice"}
			for i, at := range tt.passes {
				f.clock.Add(at - f.clock.Now().Sub(t0))
				w := f.mustDo(t, alice, http.StatusOK, 0)
				if got, want := w.Header().Get("RateLimit"), fmt.Sprintf(`"per-client";r=%d;`, len(tt.passes)-1-i); !strings.HasPrefix(got, want) {
					t.Fatalf("request %d: RateLimit %q, want %s...", i, got, want)
				}
			}
			f.clock.Add(tt.refusedAt - f.clock.Now().Sub(t0))
			w := f.mustDo(t, alice, http.StatusTooManyRequests, tt.retry)
			if got, want := w.Header().Get("RateLimit"), fmt.Sprintf(`"per-client";r=0;t=%d`, tt.retry); got != want {
				t.Errorf("RateLimit %q, want %q", got, want)
			}
			if got := w.Header().Get("RateLimit-Policy"); got != tt.policy {
				t.Errorf("RateLimit-Policy %q, want %q", got, tt.policy)
			}
			var problem struct {
				Type     string   `json:"type"`
				Violated []string `json:"violated-policies"`
			}
			if err := json.Unmarshal(w.Body.Bytes(), &problem); err != nil || problem.Type != problemQuota || len(problem.Violated) != 1 || problem.Violated[0] != "per-client" {
				t.Errorf("body %s (%v), want the quota-exceeded problem naming per-client", w.Body, err)
			}
			if tt.retry > 1 {
				f.clock.Add(time.Duration(tt.retry-1) * time.Second)
				f.mustDo(t, alice, http.StatusTooManyRequests, 1)
				f.clock.Add(time.Second)
			} else {
				f.clock.Add(time.Duration(tt.retry) * time.Second)
			}
			f.mustDo(t, alice, http.StatusOK, 0)
			f.mustDo(t, request{key: "bob"}, http.StatusOK, 0) // others were never held back
		})
	}
}

// TestAllOrNothing: a request refused by one limit leaves the others as
// they were, on a standalone Redis and on a 3-master cluster where the
// limits' keys are in different slots. Whichever limit refuses, the others
// end with what they had: on the cluster, the slots that counted the
// request give it back.
func TestAllOrNothing(t *testing.T) {
	tests := []struct {
		desc    string
		limits  []Limit
		fill    []request // requests that pass and bring the refusing limit to its end
		refused request
		want    string // the limit that refuses
	}{
		{
			desc: "per-client refuses",
			limits: []Limit{
				{Name: "overall", Key: KeyGlobal, Spec: throttle.Spec{Algorithm: throttle.TokenBucket, Limit: 10, Period: time.Minute}},
				{Name: "per-client", Key: KeyClient, Spec: spec(throttle.SlidingLog, 2, time.Minute)},
				{Name: "per-ip", Key: KeyIP, Spec: spec(throttle.SlidingCounter, 10, time.Minute)},
			},
			fill:    []request{{key: "alice"}, {key: "alice"}},
			refused: request{key: "alice"},
			want:    "per-client",
		},
		{
			desc: "overall refuses: windowed limits",
			limits: []Limit{
				{Name: "overall", Key: KeyGlobal, Spec: spec(throttle.FixedWindow, 2, time.Minute)},
				{Name: "per-client", Key: KeyClient, Spec: spec(throttle.SlidingLog, 5, time.Minute)},
				{Name: "per-ip", Key: KeyIP, Spec: spec(throttle.SlidingCounter, 5, time.Minute)},
			},
			fill:    []request{{key: "bob", peer: "198.51.100.2:1"}, {key: "carol", peer: "198.51.100.3:1"}},
			refused: request{key: "alice"},
			want:    "overall",
		},
		{
			desc: "overall refuses: buckets",
			limits: []Limit{
				{Name: "overall", Key: KeyGlobal, Spec: spec(throttle.SlidingLog, 2, time.Minute)},
				{Name: "per-client", Key: KeyClient, Spec: throttle.Spec{Algorithm: throttle.TokenBucket, Limit: 5, Period: time.Minute}},
				{Name: "per-ip", Key: KeyIP, Spec: throttle.Spec{Algorithm: throttle.LeakyBucket, Limit: 5, Period: time.Minute}},
			},
			fill:    []request{{key: "bob", peer: "198.51.100.2:1"}, {key: "carol", peer: "198.51.100.3:1"}},
			refused: request{key: "alice"},
			want:    "overall",
		},
	}
	for _, e := range engines(t) {
		for _, tt := range tests {
			t.Run(e.name+"/"+tt.desc, func(t *testing.T) {
				f := newFixture(t, e.rdb, Config{Limits: tt.limits})
				for _, r := range tt.fill {
					f.mustDo(t, r, http.StatusOK, 0)
				}
				keys := map[string]string{"overall": "global", "per-client": clientID("alice"), "per-ip": "192.0.2.1"}
				before := map[string]int{}
				for name, key := range keys {
					before[name] = f.remaining(t, name, key)
				}
				for range 5 {
					w := f.mustDo(t, tt.refused, http.StatusTooManyRequests, 0)
					if got := w.Header().Get("RateLimit"); !strings.HasPrefix(got, `"`+tt.want+`";r=0;`) {
						t.Fatalf("RateLimit %q, want %s refusing", got, tt.want)
					}
				}
				for name, key := range keys {
					if name == tt.want {
						continue
					}
					if got := f.remaining(t, name, key); got != before[name] {
						t.Errorf("%s has %d left after the refusals, want %d as before", name, got, before[name])
					}
				}
				if c, ok := e.rdb.(*redis.ClusterClient); ok {
					if slots := limitSlots(t, c, f); slots < 3 {
						t.Errorf("the limits' keys are in %d slots, want 3: the test does not cross slots", slots)
					}
				}
			})
		}
	}
}

// limitSlots counts the cluster slots the fixture's limit keys are in.
func limitSlots(t *testing.T, c *redis.ClusterClient, f *fixture) int {
	t.Helper()
	ctx := context.Background()
	var mu sync.Mutex
	slots := map[int64]bool{}
	err := c.ForEachMaster(ctx, func(ctx context.Context, m *redis.Client) error {
		for _, lim := range f.lim.limits {
			prefix := f.prefixOf(lim)
			keys, err := m.Keys(ctx, prefix+"*").Result()
			if err != nil {
				return err
			}
			for _, k := range keys {
				slot, err := c.ClusterKeySlot(ctx, k).Result()
				if err != nil {
					return err
				}
				mu.Lock()
				slots[slot] = true
				mu.Unlock()
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return len(slots)
}

func (f *fixture) prefixOf(lim *limit) string {
	return f.prefix + "limit:" + lim.Name + ":"
}

// TestAllOrNothingConcurrent: 40 clients × 10 requests at once on the
// cluster. The clients' own limits admit 200 of them, overall only 100:
// whatever the interleaving, every request overall refused is given back
// by the others, so each limit ends having counted exactly the requests
// that were served (windowed algorithms give back exactly).
func TestAllOrNothingConcurrent(t *testing.T) {
	f := newFixture(t, redistest.Cluster(t), Config{Limits: []Limit{
		{Name: "overall", Key: KeyGlobal, Spec: spec(throttle.SlidingLog, 100, time.Minute)},
		{Name: "per-client", Key: KeyClient, Spec: spec(throttle.FixedWindow, 5, time.Minute)},
		{Name: "per-ip", Key: KeyIP, Spec: spec(throttle.SlidingCounter, 1000, time.Minute)},
	}})
	const clients, each = 40, 10
	served := make([]int, clients)
	var wg sync.WaitGroup
	for c := range clients {
		for range each {
			wg.Go(func() {
				w := f.do(request{key: fmt.Sprint("client-", c), peer: fmt.Sprintf("198.51.100.%d:1", c)})
				if w.Code == http.StatusOK {
					f.mu.Lock()
					served[c]++
					f.mu.Unlock()
				}
			})
		}
	}
	wg.Wait()
	if f.served != 100 {
		t.Errorf("%d requests served, want 100 (overall's limit)", f.served)
	}
	if left := f.remaining(t, "overall", "global"); left != 0 {
		t.Errorf("overall has %d left, want 0", left)
	}
	for c := range clients {
		if used := 5 - f.remaining(t, "per-client", clientID(fmt.Sprint("client-", c))); used != served[c] {
			t.Errorf("client-%d: per-client counted %d, but %d were served", c, used, served[c])
		}
		if used := 1000 - f.remaining(t, "per-ip", fmt.Sprintf("198.51.100.%d", c)); used != served[c] {
			t.Errorf("client-%d: per-ip counted %d, but %d were served", c, used, served[c])
		}
	}
}
