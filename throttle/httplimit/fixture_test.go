package httplimit

import (
	"context"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/internal/redistest"
	"github.com/sluicehq/sluice/internal/testkit"
	"github.com/sluicehq/sluice/throttle"
)

// t0 is aligned to every period the tests use.
var t0 = time.Unix(1_800_000_000, 0)

// fixture is a Limiter on Redis with a manual clock, in front of a handler
// that answers 200 and counts the requests it sees.
type fixture struct {
	lim    *Limiter
	prefix string
	clock  *testkit.Clock
	h      http.Handler
	served int
	mu     sync.Mutex
}

func newFixture(t *testing.T, rdb redis.UniversalClient, cfg Config, opts ...Option) *fixture {
	t.Helper()
	cfg.Prefix = redistest.Prefix(t)
	f := &fixture{prefix: cfg.Prefix, clock: testkit.NewClock(t0)}
	opts = append([]Option{
		WithClock(f.clock),
		WithRegisterer(prometheus.NewRegistry()),
		WithLogger(slog.New(slog.NewTextHandler(io.Discard, nil))),
	}, opts...)
	lim, err := New(rdb, cfg, opts...)
	if err != nil {
		t.Fatal(err)
	}
	f.lim = lim
	f.h = lim.Middleware(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		f.mu.Lock()
		f.served++
		f.mu.Unlock()
	}))
	return f
}

// request is one request to a fixture.
type request struct {
	key  string   // X-API-Key; "" for none
	peer string   // RemoteAddr; default 192.0.2.1:1234
	xff  []string // X-Forwarded-For field lines
}

func (f *fixture) do(r request) *httptest.ResponseRecorder {
	req := httptest.NewRequest(http.MethodGet, "/", nil)
	if r.peer != "" {
		req.RemoteAddr = r.peer
	}
	if r.key != "" {
		req.Header.Set("X-API-Key", r.key)
	}
	for _, line := range r.xff {
		req.Header.Add("X-Forwarded-For", line)
	}
	w := httptest.NewRecorder()
	f.h.ServeHTTP(w, req)
	return w
}

// mustDo makes a request and checks its status and, if wantRetry > 0, its
// Retry-After in seconds.
func (f *fixture) mustDo(t *testing.T, r request, wantStatus, wantRetry int) *httptest.ResponseRecorder {
	t.Helper()
	w := f.do(r)
	if w.Code != wantStatus {
		t.Fatalf("at +%v: status %d (%s), want %d", f.clock.Now().Sub(t0), w.Code, w.Body, wantStatus)
	}
	if wantRetry > 0 {
		if got := w.Header().Get("Retry-After"); got != strconv.Itoa(wantRetry) {
			t.Fatalf("at +%v: Retry-After %q, want %d", f.clock.Now().Sub(t0), got, wantRetry)
		}
	}
	return w
}

// remaining is how many more requests limit name admits for key now, read
// without changing it.
func (f *fixture) remaining(t *testing.T, name, key string) int {
	t.Helper()
	for _, lim := range f.lim.limits {
		if lim.Name != name {
			continue
		}
		level, err := lim.lim.(throttle.Reserver).Peek(context.Background(), key)
		if err != nil {
			t.Fatal(err)
		}
		return level.Remaining
	}
	t.Fatalf("no limit %q", name)
	return 0
}

// metric is the value of a counter.
func (f *fixture) metric(c prometheus.Counter) int {
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		panic(err)
	}
	return int(m.GetCounter().GetValue())
}

// engines are the Redis deployments every Redis test runs on.
func engines(t *testing.T) []struct {
	name string
	rdb  redis.UniversalClient
} {
	return []struct {
		name string
		rdb  redis.UniversalClient
	}{{"redis", redistest.Client(t)}, {"cluster", redistest.Cluster(t)}}
}

func spec(a throttle.Algorithm, limit int, period time.Duration) throttle.Spec {
	return throttle.Spec{Algorithm: a, Limit: limit, Period: period}
}
