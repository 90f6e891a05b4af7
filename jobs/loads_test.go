package jobs

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/internal/redistest"
	"github.com/sluicehq/sluice/internal/testkit"
	"github.com/sluicehq/sluice/throttle"
)

// TestKeyLoads: a quota keyed by destination, 30 a minute burst 4, with an
// override of 60 a minute burst 10 for "big", on Redis's own clock (turns
// 2s apart, so a look within a second sees them all still to come): the
// busiest keys first, each with its turns waiting, its throttles and
// whether it can admit now; the gate found by its label or its bare name.
func TestKeyLoads(t *testing.T) {
	ctx := context.Background()
	for _, rdb := range []struct {
		name   string
		client func(testing.TB) redis.UniversalClient
	}{
		{"redis", func(tb testing.TB) redis.UniversalClient { return redistest.Client(tb) }},
		{"cluster", func(tb testing.TB) redis.UniversalClient { return redistest.Cluster(tb) }},
	} {
		t.Run(rdb.name, func(t *testing.T) {
			client := rdb.client(t)
			queue, quota := redistest.Queue(t, "q"), redistest.Queue(t, "api")
			cfg := Config{
				Queues: map[string]QueueConfig{queue: {}},
				Quotas: map[string]LimitConfig{quota: {Algorithm: "token_bucket", Limit: 30, Period: time.Minute, Burst: 4,
					Key: `payload.dest`, Overrides: map[string]LimitOverride{"big": {Limit: 60, Burst: 10}}}},
				Tasks: map[string]TaskConfig{"test:call": {Quotas: []string{quota}}},
			}
			s, err := NewScheduler(client, asynq.RedisClientOpt{Addr: redistest.Addr(t)}, cfg,
				NewMetrics(prometheus.NewRegistry()), slog.New(slog.NewTextHandler(io.Discard, nil)))
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { s.Close() })
			for dest, n := range map[string]int{"a": 10, "b": 5, "big": 12, "c": 1} {
				for i := range n {
					task := asynq.NewTask("test:call", fmt.Appendf(nil, `{"dest": %q}`, dest))
					if _, err := bookTask(ctx, s.booker, s.gates.Load(), queue, fmt.Sprint(dest, i), task, false); err != nil {
						t.Fatal(err)
					}
				}
			}
			// A key's first tasks are lent from a lease, which holds the
			// rest of its turns until its span ends: given back now, so
			// that the look sees the tasks' turns alone.
			s.gates.Load().close()
			want := []throttle.KeyLoad{
				{Key: "a", Waiting: 6, Throttled: 6},
				{Key: "big", Waiting: 2, Throttled: 2},
				{Key: "b", Waiting: 1, Throttled: 1},
				{Key: "c", CanAdmit: true, Remaining: 3},
			}
			got, err := KeyLoads(ctx, client, cfg, "quota:"+quota, 10)
			if err != nil {
				t.Fatal(err)
			}
			if fmt.Sprint(got) != fmt.Sprint(want) {
				t.Fatalf("KeyLoads = %+v\nwant %+v", got, want)
			}
			// By the quota's bare name, the top 2.
			if got, err := KeyLoads(ctx, client, cfg, quota, 2); err != nil || fmt.Sprint(got) != fmt.Sprint(want[:2]) {
				t.Fatalf("KeyLoads(bare name, top 2) = %+v, %v; want %+v", got, err, want[:2])
			}
			for _, tc := range []struct{ gate, err string }{
				{"drain:" + queue, "is not a keyed gate of the config; its keyed gates are quota:" + quota},
				{queue, "is a queue: name one of its gates"},
				{"quota:nope", "is not a keyed gate"},
				{"queue:" + queue, `the kinds are drain, fair, quota and concurrency, got "queue"; the config's keyed gates are quota:`},
				{strings.Repeat("x", 100_000), "a gate's name is at most 512 bytes, got 100000"},
			} {
				if _, err := KeyLoads(ctx, client, cfg, tc.gate, 20); err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Errorf("KeyLoads(%.40q): %v, want an error with %q", tc.gate, err, tc.err)
				}
			}
			for _, top := range []int{0, MaxKeyLoads + 1} {
				if _, err := KeyLoads(ctx, client, cfg, quota, top); err == nil {
					t.Errorf("KeyLoads(top %d) did not fail", top)
				}
			}
		})
	}
}

// TestKeyLoadsOneScan (19.11): a keyed quota with 30 overrides is read in
// one pass over the keyspace, whatever the overrides: at most twice the
// SCAN calls of one plain pass (the keyspace may grow under other tests
// meanwhile), and its keys and the overrides' listed. (It was scanned once
// for the quota and once per override: 1,000 overrides, 200,000 keys took
// 207.6s.)
func TestKeyLoadsOneScan(t *testing.T) {
	ctx := context.Background()
	rdb := redistest.Client(t)
	scans := &scriptCalls{command: "scan"}
	rdb.AddHook(scans)
	queue, quota := redistest.Queue(t, "q"), redistest.Queue(t, "api")
	overrides := map[string]LimitOverride{}
	for i := range 30 {
		overrides[fmt.Sprint("o", i)] = LimitOverride{Limit: 100 + i}
	}
	cfg := Config{
		Queues: map[string]QueueConfig{queue: {}},
		Quotas: map[string]LimitConfig{quota: {Limit: 10, Period: time.Second, Key: "payload.dest", Overrides: overrides}},
		Tasks:  map[string]TaskConfig{"test:call": {Quotas: []string{quota}}},
	}
	s := newScheduler(t, rdb, cfg)
	for _, dest := range []string{"a", "o3", "o29"} {
		task := asynq.NewTask("test:call", fmt.Appendf(nil, `{"dest": %q}`, dest))
		if _, err := bookTask(ctx, s.booker, s.gates.Load(), queue, dest, task, false); err != nil {
			t.Fatal(err)
		}
	}
	s.gates.Load().close() // the keys' leases given back: only their states stay
	// 3,000 other keys, so that one pass takes several calls.
	prefix := redistest.Prefix(t)
	var filler []string
	var pairs []any
	for i := range 3000 {
		filler = append(filler, fmt.Sprint(prefix, i))
		pairs = append(pairs, filler[i], "x")
	}
	if err := rdb.MSet(ctx, pairs...).Err(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { rdb.Del(context.Background(), filler...) })

	scans.count.Store(0)
	it := rdb.Scan(ctx, 0, prefix+"none:*", 1000).Iterator()
	for it.Next(ctx) {
	}
	pass := scans.count.Load()
	scans.count.Store(0)
	loads, err := KeyLoads(ctx, rdb, cfg, "quota:"+quota, 10)
	if err != nil {
		t.Fatal(err)
	}
	var keys []string
	for _, l := range loads {
		keys = append(keys, l.Key)
	}
	slices.Sort(keys)
	if fmt.Sprint(keys) != "[a o29 o3]" {
		t.Errorf("KeyLoads listed %v, want a, o29 and o3", keys)
	}
	t.Logf("one pass over the keyspace: %d SCAN calls; KeyLoads of a gate with %d overrides: %d", pass, len(overrides), scans.count.Load())
	if got := scans.count.Load(); got > 2*pass {
		t.Errorf("KeyLoads made %d SCAN calls, want at most %d: twice one pass (%d) over the keyspace", got, 2*pass, pass)
	}
}

// TestFairKeyLoads: a fair queue's keys as its lines hold them, on a test
// clock: tasks parked in a key's line count as waiting and as throttled;
// a minute and more later they still wait but no longer count as
// throttled, and the next park sweeps the quiet key's count out of the
// queue's hash of counts.
func TestFairKeyLoads(t *testing.T) {
	ctx := context.Background()
	clock := testkit.NewClock(t0)
	rdb := redistest.Client(t)
	queue := redistest.Queue(t, "fair")
	drain := LimitConfig{Algorithm: "leaky_bucket", Limit: 10, Period: time.Second, Burst: 1}
	cfg := Config{Queues: map[string]QueueConfig{queue: {Drain: &drain, Fairness: &FairnessConfig{Key: "payload.t"}}}}
	s, err := NewScheduler(rdb, asynq.RedisClientOpt{Addr: redistest.Addr(t)}, cfg,
		NewMetrics(prometheus.NewRegistry()), slog.New(slog.NewTextHandler(io.Discard, nil)), WithClock(clock))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	f := s.gates.Load().fair[queue]
	park := func(key string, n int) {
		t.Helper()
		for i := range n {
			id := fmt.Sprintf("%s-%d-%d", key, clock.Now().Unix(), i)
			if _, _, err := s.park(ctx, queue, id, &lineSpot{fair: f, key: key, booking: queue + "/" + id, cost: 1}); err != nil {
				t.Fatal(err)
			}
		}
	}
	loads := func() map[string]throttle.KeyLoad {
		t.Helper()
		got, err := throttle.Loads(ctx, f.lim)
		if err != nil {
			t.Fatal(err)
		}
		byKey := map[string]throttle.KeyLoad{}
		for _, l := range got {
			byKey[l.Key] = l
		}
		return byKey
	}
	park("a b", 3)
	if got := loads(); len(got) != 1 || got["a b"].Waiting != 3 || got["a b"].Throttled != 3 {
		t.Fatalf("after 3 parked: %+v, want key \"a b\" with 3 waiting, 3 throttled", got)
	}
	clock.Add(80 * time.Second)
	park("c", 1)
	got := loads()
	if len(got) != 2 || got["a b"].Waiting != 3 || got["a b"].Throttled != 0 || got["c"].Waiting != 1 || got["c"].Throttled != 1 {
		t.Fatalf("80s on, 1 more parked for c: %+v, want \"a b\" 3 waiting, 0 throttled; c 1 and 1", got)
	}
	counts := f.keys[len(f.keys)-1]
	if fields, err := rdb.HKeys(ctx, counts).Result(); err != nil || len(fields) != 2 || !slices.Contains(fields, "c") {
		t.Fatalf("the queue's counts hold %v (%v), want c's and the sweep's mark: the quiet key swept out", fields, err)
	}
}
