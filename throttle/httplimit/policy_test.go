package httplimit

import (
	"bytes"
	"cmp"
	"log/slog"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/internal/testkit"
	"github.com/sluicehq/sluice/throttle"
)

// TestRedisDown: with Redis unreachable each limit follows its policy —
// deny answers 503, allow serves uncounted, local counts in process at
// the limit (or its share) — and the metrics count every use. The log gets
// one line per limit, and never an API key.
func TestRedisDown(t *testing.T) {
	addr := testkit.FreeAddr(t) // nothing listens there
	rdb := redis.NewClient(&redis.Options{Addr: addr, MaxRetries: -1, DialTimeout: 100 * time.Millisecond, DialerRetries: 1, DialerRetryTimeout: time.Millisecond})
	t.Cleanup(func() { rdb.Close() })

	tests := []struct {
		desc      string
		policy    string
		divisor   int
		ban       Ban
		statuses  []int  // of 4 requests in a row
		rateLimit string // of the last one
	}{
		{desc: "deny refuses with 503", policy: OnRedisErrorDeny, statuses: []int{503, 503, 503, 503}},
		{desc: "the default is deny", statuses: []int{503, 503, 503, 503}},
		{desc: "allow serves uncounted", policy: OnRedisErrorAllow, statuses: []int{200, 200, 200, 200}},
		{desc: "allow serves when bans cannot be checked either", policy: OnRedisErrorAllow, ban: Ban{After: 1, Within: time.Minute, For: time.Minute}, statuses: []int{200, 200, 200, 200}},
		{desc: "local counts at the full limit", policy: OnRedisErrorLocal, statuses: []int{200, 200, 200, 429}, rateLimit: `"per-client";r=0;t=60`},
		{desc: "local counts at its share", policy: OnRedisErrorLocal, divisor: 2, statuses: []int{200, 429, 429, 429}, rateLimit: `"per-client";r=0;t=60`},
	}
	for _, tt := range tests {
		t.Run(tt.desc, func(t *testing.T) {
			var log bytes.Buffer
			f := newFixture(t, rdb, Config{
				Limits: []Limit{{Name: "per-client", Key: KeyClient, Spec: spec(throttle.SlidingLog, 3, time.Minute), OnRedisError: tt.policy, LocalDivisor: tt.divisor}},
				Ban:    tt.ban,
			}, WithLogger(slog.New(slog.NewTextHandler(&log, nil))))
			var last *httptest.ResponseRecorder
			for i, want := range tt.statuses {
				rec := f.do(request{key: "s3cr3t-key"})
				if rec.Code != want {
					t.Fatalf("request %d: status %d (%s), want %d", i, rec.Code, rec.Body, want)
				}
				if want == 503 && rec.Header().Get("Retry-After") != "1" {
					t.Errorf("503 with Retry-After %q, want 1", rec.Header().Get("Retry-After"))
				}
				last = rec
			}
			if got := last.Header().Get("RateLimit"); got != tt.rateLimit {
				t.Errorf("RateLimit %q, want %q", got, tt.rateLimit)
			}
			policy := cmp.Or(tt.policy, OnRedisErrorDeny)
			if got := f.metric(f.lim.metrics.fallbacks.WithLabelValues("per-client", policy)); got != 4 {
				t.Errorf("sluice_http_policy_fallbacks_total{policy=%s} = %d, want 4", policy, got)
			}
			if got := f.metric(f.lim.metrics.redisErrors.WithLabelValues("per-client")); got != 4 {
				t.Errorf("sluice_http_redis_errors_total{limit=per-client} = %d, want 4", got)
			}
			if tt.ban != (Ban{}) {
				// The address and the API key: two bans to check per request.
				if got := f.metric(f.lim.metrics.redisErrors.WithLabelValues("ban")); got != 8 {
					t.Errorf("sluice_http_redis_errors_total{limit=ban} = %d, want 8", got)
				}
			}
			lines := strings.Count(log.String(), "\n")
			if want := 1 + btoi(tt.ban != (Ban{})); lines != want {
				t.Errorf("%d log lines, want %d:\n%s", lines, want, &log)
			}
			if strings.Contains(log.String(), "s3cr3t") {
				t.Errorf("the log holds the API key:\n%s", &log)
			}
		})
	}
}

func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}
