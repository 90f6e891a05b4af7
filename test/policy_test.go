package test

import (
	"fmt"
	"testing"
	"time"

	"github.com/sluicehq/sluice/internal/redistest"
)

// TestQuotaRedisRefused: worker processes whose Redis user may touch the
// queues but not the quota's keys (a Redis ACL), so every call of the quota
// gate fails while asynq works: the gate does what its on_redis_error says,
// and the worker counts it. (jobs.TestRedisUnreachable does the same with
// the limits' Redis at a closed port.) The local policy waits until the
// worker has counted the fleet, 2 to 3 s after it starts.
func TestQuotaRedisRefused(t *testing.T) {
	t.Parallel()
	cases := []struct {
		policy string
		check  func(t *testing.T, calls []time.Time)
	}{
		{"deny", func(t *testing.T, calls []time.Time) {
			if len(calls) != 0 {
				t.Fatalf("%d calls went through a quota whose policy is deny", len(calls))
			}
		}},
		{"allow", func(t *testing.T, calls []time.Time) {
			if len(calls) != 20 {
				t.Fatalf("%d of 20 calls went through a quota whose policy is allow", len(calls))
			}
		}},
		{"local", func(t *testing.T, calls []time.Time) {
			// 4/s, burst 1, for one worker: at most 1 + 4·T in any span T.
			if len(calls) == 0 || overAllowance(calls, 1, 4) > 0 {
				t.Fatalf("%d calls in 6 s through a local twin of 4/s (%s)", len(calls), densest(calls, time.Second))
			}
		}},
	}
	for _, c := range cases {
		t.Run(c.policy, func(t *testing.T) {
			t.Parallel()
			u := newUpstream(t)
			queue := redistest.Queue(t, "q")
			quota := redistest.Queue(t, "api")
			user, password := aclUserWithoutQuotas(t)
			config := writeConfig(t, fmt.Sprintf(`
redis: {addr: %s, username: %s, password: %s}
queues: {%s: {}}
quotas:
  %s: {algorithm: token_bucket, limit: 4, period: 1s, burst: 1, on_redis_error: %s}
tasks:
  http:request: {quotas: [%s]}
http: {allow: ['%s']}
`, redistest.Addr(t), user, password, queue, quota, c.policy, quota, u.Listener.Addr().String()))
			w := startWorker(t, config)
			enqueueRequests(t, u, queue, "r", 20)
			time.Sleep(6 * time.Second)
			t.Logf("policy %s: %d of 20 calls in 6 s", c.policy, len(u.All()))
			c.check(t, u.All())
			if n := w.counter(t, "sluice_policy_fallbacks_total", `policy="`+c.policy+`"`); n == 0 {
				t.Fatalf("sluice_policy_fallbacks_total{policy=%q} is 0", c.policy)
			}
			if n := w.counter(t, "sluice_redis_errors_total"); n == 0 {
				t.Fatal("sluice_redis_errors_total is 0")
			}
			if info := redistest.QueueInfo(t, queue); info.Archived != 0 {
				t.Fatalf("%d tasks archived", info.Archived)
			}
		})
	}
}

// aclUserWithoutQuotas makes a Redis user that may use asynq's keys and
// sluice's own, but not those of quotas, and removes it when the test ends.
func aclUserWithoutQuotas(t *testing.T) (user, password string) {
	return redistest.ACLUser(t, "asynq:*", "sluice:drain:*", "sluice:rate:*", "sluice:rescue:*", "sluice:rebook:*", "sluice:concurrency:*")
}
