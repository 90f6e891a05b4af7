package jobs

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/internal/redistest"
)

// TestKeyedQuotaMemoryBack (issue 13, Scale): on a redis-server of its own,
// 10,000 key values of a keyed quota (token bucket 2/s, burst 2) each book
// 4 tasks, two of which wait, so that every key also keeps its one-minute
// count of throttles; once every TTL has passed (the counts' 70s the
// longest), Redis holds no key it did not hold before, and its used_memory
// is back to what it was. It waits those 70s beside the package's other
// tests.
func TestKeyedQuotaMemoryBack(t *testing.T) {
	t.Parallel()
	const keys, each, callers = 10_000, 4, 32
	server := redistest.StartServer(t, "--appendonly", "no")
	rdb := redis.NewClient(&redis.Options{Addr: server.Addr})
	defer rdb.Close()
	ctx := context.Background()
	queue, quota := "q", "scale"
	cfg := Config{
		Queues: map[string]QueueConfig{queue: {}},
		Quotas: map[string]LimitConfig{quota: {Algorithm: "token_bucket", Limit: 2, Period: time.Second, Burst: 2, Key: `payload.dest`}},
		Tasks:  map[string]TaskConfig{"test:call": {Quotas: []string{quota}}},
	}
	s, err := NewScheduler(rdb, asynq.RedisClientOpt{Addr: server.Addr}, cfg,
		NewMetrics(prometheus.NewRegistry()), slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	bookAll := func(keys, each int, prefix string) {
		var wg sync.WaitGroup
		for c := range callers {
			wg.Go(func() {
				for k := c; k < keys; k += callers {
					task := asynq.NewTask("test:call", fmt.Appendf(nil, `{"dest": "%s%d"}`, prefix, k))
					for i := range each {
						if _, err := s.book(ctx, s.gates.Load(), queue, fmt.Sprintf("%s%d-%d", prefix, k, i), task, false); err != nil {
							t.Errorf("key %d task %d: %v", k, i, err)
							return
						}
					}
				}
			})
		}
		wg.Wait()
	}
	dbsize := func() int64 { return rdb.DBSize(ctx).Val() }
	waitEmpty := func(within time.Duration) time.Duration {
		start := time.Now()
		for dbsize() > 0 {
			if time.Since(start) > within {
				t.Fatalf("%d keys still in Redis %v after the last booking, e.g. %v", dbsize(), within, scanKeys(t, rdb, "*")[:1])
			}
			time.Sleep(500 * time.Millisecond)
		}
		return time.Since(start)
	}

	// The scripts loaded and run once, everything they wrote expired (no
	// task waited: no count of throttles to wait for): the baseline.
	bookAll(10, 2, "warm")
	waitEmpty(10 * time.Second)
	baseline := usedMemory(t, rdb)

	bookAll(keys, each, "k")
	if t.Failed() {
		t.FailNow()
	}
	peak, peakKeys := usedMemory(t, rdb), dbsize()
	gone := waitEmpty(80 * time.Second)
	// Expired keys leave the dictionaries' tables a moment longer: Redis
	// shrinks them in its cron.
	var after int64
	for range 20 {
		if after = usedMemory(t, rdb); after-baseline < 64<<10 {
			break
		}
		time.Sleep(250 * time.Millisecond)
	}
	t.Logf("%d keys × %d tasks: %d Redis keys, used_memory %+.2f MB over the baseline; all gone %v after the last booking, used_memory then %+d bytes",
		keys, each, peakKeys, float64(peak-baseline)/1e6, gone.Round(100*time.Millisecond), after-baseline)
	if peakKeys < keys {
		t.Fatalf("%d Redis keys after booking %d key values: the test measured nothing", peakKeys, keys)
	}
	if after-baseline >= 64<<10 {
		t.Fatalf("used_memory %d bytes over the baseline once every key expired (peak %+d), want under 64 KiB", after-baseline, peak-baseline)
	}
}
