package httplimit

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/internal/redistest"
	"github.com/sluicehq/sluice/throttle"
)

// scriptCalls counts the commands a client sends.
type scriptCalls struct{ n atomic.Int64 }

func (h *scriptCalls) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *scriptCalls) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		h.n.Add(1)
		return next(ctx, cmd)
	}
}
func (h *scriptCalls) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		h.n.Add(int64(len(cmds)))
		return next(ctx, cmds)
	}
}

// TestLentRequests: on the system clock, requests of clients far from
// their limits pass on events lent in batches (throttle.Pool), with far
// fewer Redis calls than requests; pushed past the limits, the requests
// admitted still never exceed any of them at the instants they passed.
func TestLentRequests(t *testing.T) {
	for i, e := range engines(t) {
		// The overall and per-client keys lie in one slot on Redis, in two
		// on the cluster: a lease is a call per slot.
		slots := int64(i + 1)
		t.Run(e.name, func(t *testing.T) {
			calls := &scriptCalls{}
			rdb := e.rdb
			rdb.AddHook(calls)
			global := throttle.Spec{Algorithm: throttle.TokenBucket, Limit: 600, Period: time.Second, Burst: 300}
			perClient := throttle.Spec{Algorithm: throttle.TokenBucket, Limit: 200, Period: time.Second, Burst: 100}
			lim, err := New(rdb, Config{
				Prefix: redistest.Prefix(t),
				Limits: []Limit{{Name: "overall", Key: KeyGlobal, Spec: global}, {Name: "per-client", Key: KeyClient, Spec: perClient}},
			}, WithRegisterer(prometheus.NewRegistry()), WithLogger(slog.New(slog.NewTextHandler(io.Discard, nil))))
			if err != nil {
				t.Fatal(err)
			}
			var mu sync.Mutex
			passed := map[string][]time.Time{}
			h := lim.Middleware(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				at := time.Now()
				mu.Lock()
				passed[r.Header.Get("X-API-Key")] = append(passed[r.Header.Get("X-API-Key")], at)
				mu.Unlock()
			}))
			send := func(client string) int {
				req := httptest.NewRequest(http.MethodGet, "/", nil)
				req.Header.Set("X-API-Key", client)
				w := httptest.NewRecorder()
				h.ServeHTTP(w, req)
				return w.Code
			}
			// Far below the limits: 3 clients, 50 requests/s each, for 1s.
			var wg sync.WaitGroup
			for c := range 3 {
				wg.Go(func() {
					for range 50 {
						if code := send(fmt.Sprint("client-", c)); code != http.StatusOK {
							t.Errorf("a request far below the limits answered %d", code)
						}
						time.Sleep(20 * time.Millisecond)
					}
				})
			}
			wg.Wait()
			t.Logf("150 requests far below the limits: %d Redis commands", calls.n.Load())
			if n, most := calls.n.Load(), 50*slots; n > most {
				t.Errorf("150 requests far below the limits took %d Redis commands, want at most %d (one per 3 requests per slot): leases should serve most", n, most)
			}
			// Past them: 3 clients as fast as they can for 1s.
			for c := range 3 {
				wg.Go(func() {
					for start := time.Now(); time.Since(start) < time.Second; {
						send(fmt.Sprint("client-", c))
					}
				})
			}
			wg.Wait()
			var all []time.Time
			for client, times := range passed {
				if over := overSpec(perClient, times); over > 0 {
					t.Errorf("%s: %d requests over its limit", client, over)
				}
				all = append(all, times...)
			}
			if over := overSpec(global, all); over > 0 {
				t.Errorf("%d requests over the overall limit", over)
			}
		})
	}
}

// overSpec is how far the instants exceed a bucket of spec at their worst:
// the most of them in any interval of length T less Burst + Limit·T/Period.
func overSpec(spec throttle.Spec, times []time.Time) int {
	sorted := append([]time.Time(nil), times...)
	slices.SortFunc(sorted, time.Time.Compare)
	worst := 0
	for i := range sorted {
		for j := i; j < len(sorted); j++ {
			allowed := spec.Burst + int(int64(spec.Limit)*int64(sorted[j].Sub(sorted[i]))/int64(spec.Period))
			worst = max(worst, j-i+1-allowed)
		}
	}
	return worst
}
