package throttle_test

import (
	"context"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/algorithms"
	"github.com/sluicehq/sluice/internal/redistest"
	"github.com/sluicehq/sluice/internal/testkit"
	"github.com/sluicehq/sluice/throttle"
)

// t0 is aligned to every period the tests use, so fixed windows and
// sub-windows start there.
var t0 = time.Unix(1_800_000_000, 0)

// engine builds limiters of one kind. Every test runs on all engines.
type engine struct {
	name string
	rdb  redis.UniversalClient // nil for the local engine
	new  func(spec throttle.Spec, opts ...throttle.Option) (throttle.Reserver, error)
}

func engines(t *testing.T) []engine {
	t.Helper()
	standalone, cluster := redistest.Client(t), redistest.Cluster(t)
	// Where the server has functions (Redis 7), the scripts run as one:
	// this client runs them as scripts (EVALSHA), as on Redis 6 and
	// miniredis, so that both paths meet every test.
	scripts := redistest.Client(t)
	algorithms.BookScript.ScriptsOnly(scripts)
	// Each test has its own key prefix on the shared servers.
	prefixed := func(rdb redis.UniversalClient) func(throttle.Spec, ...throttle.Option) (throttle.Reserver, error) {
		prefix := redistest.Prefix(t)
		return func(spec throttle.Spec, opts ...throttle.Option) (throttle.Reserver, error) {
			opts = append([]throttle.Option{throttle.WithPrefix(prefix + string(spec.Algorithm) + ":")}, opts...)
			return throttle.New(rdb, spec, opts...)
		}
	}
	return []engine{
		{name: "local", new: throttle.NewLocal},
		{name: "redis", rdb: standalone, new: prefixed(standalone)},
		{name: "redis-evalsha", rdb: scripts, new: prefixed(scripts)},
		{name: "cluster", rdb: cluster, new: prefixed(cluster)},
	}
}

// forEach runs body as a subtest for every engine and algorithm.
func forEach(t *testing.T, body func(t *testing.T, e engine, a throttle.Algorithm)) {
	for _, e := range engines(t) {
		for _, a := range throttle.Algorithms {
			t.Run(e.name+"/"+string(a), func(t *testing.T) { body(t, e, a) })
		}
	}
}

// mustLimiter builds a limiter on e with a manual clock set to t0.
func mustLimiter(t *testing.T, e engine, spec throttle.Spec) (throttle.Reserver, *testkit.Clock) {
	t.Helper()
	clock := testkit.NewClock(t0)
	lim, err := e.new(spec, throttle.WithClock(clock))
	if err != nil {
		t.Fatalf("%s: %v", e.name, err)
	}
	return lim, clock
}

func allow(t *testing.T, lim throttle.Limiter, key string, n int) throttle.Decision {
	t.Helper()
	d, err := lim.AllowN(context.Background(), key, n)
	if err != nil {
		t.Fatalf("AllowN(%q, %d): %v", key, n, err)
	}
	return d
}
