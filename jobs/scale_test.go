package jobs

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/internal/redistest"
)

// TestKeyedQuotaScale (issue 13, Scale): 10,000 distinct keys on one keyed
// quota (token bucket 2/s, burst 2), 4 tasks each booked through the
// scheduler by 32 callers at once, on Redis's own clock, on the standalone
// server and on the cluster (the keys over every slot): every key's turns
// hold 2 + 2·T in every interval T (exact: turns are Redis instants), and
// once the turns have passed, the keys the gate keeps in Redis go back to
// none but the one-minute counts of recent throttles (one per key, each to
// expire within 70s), which the test measures, with used_memory, and
// logs. It runs beside the package's other tests that wait (its figures
// are Redis's instants and key counts, not the wall clock's).
func TestKeyedQuotaScale(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name   string
		client func(testing.TB) redis.UniversalClient
	}{
		{"redis", func(tb testing.TB) redis.UniversalClient { return redistest.Client(tb) }},
		{"cluster", func(tb testing.TB) redis.UniversalClient { return redistest.Cluster(tb) }},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			testKeyedQuotaScale(t, c.client(t))
		})
	}
}

func testKeyedQuotaScale(t *testing.T, rdb redis.UniversalClient) {
	const keys, each, callers = 10_000, 4, 32
	ctx := context.Background()
	queue, quota := redistest.Queue(t, "q"), redistest.Queue(t, "scale")
	cfg := Config{
		Queues: map[string]QueueConfig{queue: {}},
		Quotas: map[string]LimitConfig{quota: {Algorithm: "token_bucket", Limit: 2, Period: time.Second, Burst: 2, Key: `payload.dest`}},
		Tasks:  map[string]TaskConfig{"test:call": {Quotas: []string{quota}}},
	}
	s, err := NewScheduler(rdb, asynq.RedisClientOpt{Addr: redistest.Addr(t)}, cfg,
		NewMetrics(prometheus.NewRegistry()), slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	pattern := "sluice:quota:*:k:" + quota + ":*"
	baseline := usedMemory(t, rdb)

	turns := make([][]time.Time, keys)
	start := time.Now()
	var wg sync.WaitGroup
	for c := range callers {
		wg.Go(func() {
			for k := c; k < keys; k += callers {
				task := asynq.NewTask("test:call", fmt.Appendf(nil, `{"dest": "k%d"}`, k))
				for i := range each {
					b, err := bookTask(ctx, s.booker, s.gates.Load(), queue, fmt.Sprintf("k%d-%d", k, i), task, false)
					if err != nil || b.askIn > 0 || len(b.turns) != 1 {
						t.Errorf("key %d task %d: %+v, %v; want a turn", k, i, b, err)
						return
					}
					turns[k] = append(turns[k], b.turns[0].At)
				}
			}
		})
	}
	wg.Wait()
	booked := time.Since(start)
	if t.Failed() {
		t.FailNow()
	}
	peak, peakKeys := usedMemory(t, rdb), countKeys(t, rdb, pattern)
	for k, at := range turns {
		slices.SortFunc(at, func(a, b time.Time) int { return a.Compare(b) })
		for i := range at {
			for j := i + 1; j < len(at); j++ {
				// j-i+1 events in [at[i], at[j]]: at most 2 + 2·T.
				if allowed := 2 + 2*at[j].Sub(at[i]).Seconds(); float64(j-i+1) > allowed+1e-9 {
					t.Fatalf("key k%d: %d turns within %v, want at most %.2f (2 + 2·T): %v", k, j-i+1, at[j].Sub(at[i]), allowed, at)
				}
			}
		}
		if last := at[len(at)-1].Sub(at[0]); last < time.Second-time.Millisecond {
			t.Fatalf("key k%d: its 4 turns within %v, want them spread over at least 1s", k, last)
		}
	}
	// Every turn has passed 1s after the last one booked; the state lives
	// as long as it holds something, and its turns' IDs until their turn.
	var left []string
	deadline := time.Now().Add(8 * time.Second)
	for {
		left = left[:0]
		for _, key := range scanKeys(t, rdb, pattern) {
			if !strings.HasSuffix(key, ":x") {
				left = append(left, key)
			}
		}
		if len(left) == 0 || time.Now().After(deadline) {
			break
		}
		time.Sleep(200 * time.Millisecond)
	}
	gone := time.Since(start) - booked
	if len(left) > 0 {
		t.Fatalf("%d limiter keys left %v after the last booking, e.g. %v", len(left), gone.Round(100*time.Millisecond), left[:min(3, len(left))])
	}
	recent := scanKeys(t, rdb, pattern)
	var recentBytes int64
	for _, key := range recent {
		ttl := rdb.PTTL(ctx, key).Val()
		if ttl == -2 {
			continue // expired since the scan (go-redis's -2: no such key)
		}
		if ttl <= 0 || ttl > 70*time.Second {
			t.Fatalf("%s: TTL %v, want at most 70s", key, ttl)
		}
		recentBytes += rdb.MemoryUsage(ctx, key).Val()
	}
	if len(recent) > keys {
		t.Fatalf("%d counts of recent throttles, want at most one per key (%d)", len(recent), keys)
	}
	after := usedMemory(t, rdb)
	t.Logf("%d keys × %d tasks booked in %v (%.0f bookings/s, %d callers); %d gate keys in Redis after booking, used_memory %+.1f MB over baseline; "+
		"limiter state gone %v after the last booking; left: %d counts of recent throttles (%.1f MB by MEMORY USAGE, each expiring within 70s), used_memory %+.1f MB over baseline",
		keys, each, booked.Round(time.Millisecond), float64(keys*each)/booked.Seconds(), callers, peakKeys, float64(peak-baseline)/1e6,
		gone.Round(100*time.Millisecond), len(recent), float64(recentBytes)/1e6, float64(after-baseline)/1e6)
}

// forEachServer runs fn on rdb's one server, or on every master of a
// cluster.
func forEachServer(t *testing.T, rdb redis.UniversalClient, fn func(c redis.Cmdable) error) {
	t.Helper()
	var err error
	if cc, ok := rdb.(*redis.ClusterClient); ok {
		var mu sync.Mutex
		err = cc.ForEachMaster(context.Background(), func(_ context.Context, c *redis.Client) error {
			mu.Lock()
			defer mu.Unlock()
			return fn(c)
		})
	} else {
		err = fn(rdb)
	}
	if err != nil {
		t.Fatal(err)
	}
}

// usedMemory is INFO memory's used_memory (summed over a cluster's masters).
func usedMemory(t *testing.T, rdb redis.UniversalClient) int64 {
	t.Helper()
	var total int64
	forEachServer(t, rdb, func(c redis.Cmdable) error {
		info, err := c.Info(context.Background(), "memory").Result()
		if err != nil {
			return err
		}
		for line := range strings.SplitSeq(info, "\r\n") {
			if v, ok := strings.CutPrefix(line, "used_memory:"); ok {
				n, err := strconv.ParseInt(v, 10, 64)
				total += n
				return err
			}
		}
		return fmt.Errorf("INFO memory has no used_memory")
	})
	return total
}

func scanKeys(t *testing.T, rdb redis.UniversalClient, pattern string) []string {
	t.Helper()
	var keys []string
	forEachServer(t, rdb, func(c redis.Cmdable) error {
		it := c.Scan(context.Background(), 0, pattern, 1000).Iterator()
		for it.Next(context.Background()) {
			keys = append(keys, it.Val())
		}
		return it.Err()
	})
	return keys
}

func countKeys(t *testing.T, rdb redis.UniversalClient, pattern string) int {
	t.Helper()
	return len(scanKeys(t, rdb, pattern))
}
