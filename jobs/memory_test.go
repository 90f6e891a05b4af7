package jobs

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"log/slog"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/internal/redistest"
	"github.com/sluicehq/sluice/internal/testkit"
)

// TestKeyedQuotaMemoryBack (issue 13, Scale): on a redis-server of its own,
// 10,000 key values of a keyed quota (token bucket 2/s, burst 2) each book
// 4 tasks, two of which wait, so that every key also keeps its one-minute
// count of throttles; once every TTL has passed (the counts' 70s the
// longest), Redis holds no key it did not hold before, and its used_memory
// is back to what it was. It books among the package's first tests, in
// sequence, and waits those 70s beside the others: the TTLs run on while
// it waits for its place among the parallel tests.
func TestKeyedQuotaMemoryBack(t *testing.T) {
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
						if _, err := bookTask(ctx, s.booker, s.gates.Load(), queue, fmt.Sprintf("%s%d-%d", prefix, k, i), task, false); err != nil {
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
	// waitEmpty waits until Redis holds no key, at most within after
	// booked, the last booking's end, and returns how long after it that was.
	waitEmpty := func(booked time.Time, within time.Duration) time.Duration {
		for dbsize() > 0 {
			if time.Since(booked) > within {
				t.Fatalf("%d keys still in Redis %v after the last booking, e.g. %v", dbsize(), within, scanKeys(t, rdb, "*")[:1])
			}
			time.Sleep(500 * time.Millisecond)
		}
		return time.Since(booked)
	}

	// The scripts loaded and run once, everything they wrote expired (no
	// task waited: no count of throttles to wait for): the baseline.
	bookAll(10, 2, "warm")
	waitEmpty(time.Now(), 10*time.Second)
	baseline := usedMemory(t, rdb)

	bookAll(keys, each, "k")
	if t.Failed() {
		t.FailNow()
	}
	booked := time.Now()
	peak, peakKeys := usedMemory(t, rdb), dbsize()
	t.Parallel() // the TTLs run on while the package's tests in sequence do
	gone := waitEmpty(booked, 80*time.Second)
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

// bigPayload is a task payload of maxKeyedPayload bytes (1 MiB, the
// largest one key expressions read) whose field name holds value, and a
// body that fills the rest.
func bigPayload(name, value string) []byte {
	head := fmt.Appendf(nil, `{%q: %q, "body": "`, name, value)
	body := bytes.Repeat([]byte("a"), maxKeyedPayload-len(head)-2)
	return slices.Concat(head, body, []byte(`"}`))
}

// longKeyValue is the i-th key value of maxKeyName bytes, the longest a
// worker keeps as it is (a longer one is kept as its hash): the most a
// key value's copy can cost.
func longKeyValue(i int, suffix string) string {
	v := fmt.Sprintf("k%06d-", i)
	return v + strings.Repeat("x", maxKeyName-len(v)-len(suffix)) + suffix
}

// liveHeap is the heap in use after a collection: what is kept alive.
func liveHeap() int64 {
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return int64(m.HeapAlloc)
}

// heapBound checks, every checkEvery key values and at the last, that
// the live heap grew at most perKey for each key value so far (plus
// heapSlack for the collector's and the test's own noise) since baseline;
// it fails at once when it did not, so that payloads kept alive fail the
// test before they fill the machine.
type heapBound struct {
	t        *testing.T
	what     string
	baseline int64
	perKey   int64
}

const (
	checkEvery = 64
	heapSlack  = 2 << 20
)

func (h *heapBound) check(keys, of int) int64 {
	h.t.Helper()
	if keys%checkEvery != 0 && keys != of {
		return 0
	}
	grew := liveHeap() - h.baseline
	if grew > int64(keys)*h.perKey+heapSlack {
		h.t.Fatalf("%s: the live heap grew %.1f MiB after %d of %d key values (%.1f KiB each), want at most %.1f KiB each plus %d MiB: key values keep their payloads alive",
			h.what, float64(grew)/(1<<20), keys, of, float64(grew)/float64(keys)/1024, float64(h.perKey)/1024, heapSlack>>20)
	}
	return grew
}

// keysAtScale is how many key values a memory test goes through: its
// bound's worth (some 10 ms a key value), or a 128th with -short or under
// the race detector, which reads JSON at some 10 MB/s (each key value's
// task brings a payload of 1 MiB).
func keysAtScale(bound int) int {
	if testing.Short() || testkit.RaceEnabled {
		return bound / 128
	}
	return bound
}

// TestKeyedPoolsMemory (issue 19): a quota keyed by host(payload.url),
// far from its limits, lends each host's tasks turns from a pool of the
// host's own, kept after the task (maxKeyedPools of them). With payloads
// of 1 MiB and hosts of maxKeyName bytes, the live heap grows at most
// 4 KiB per pool (plus 2 MiB): the pools keep copies of the key values,
// not the payloads they were read from (1 MiB each before). With -short or
// under the race detector it goes through a 128th of the pools.
func TestKeyedPoolsMemory(t *testing.T) {
	queue, quota := redistest.Queue(t, "q"), redistest.Queue(t, "hosts")
	limit := farQuota()
	limit.Key = "host(payload.url)"
	s := newTestScheduler(t, Config{
		Queues: map[string]QueueConfig{queue: {}},
		Quotas: map[string]LimitConfig{quota: limit},
		Tasks:  map[string]TaskConfig{"test:call": {Quotas: []string{quota}}},
	})
	gs := s.gates.Load()
	book := func(i int, payload []byte) {
		t.Helper()
		b, err := bookTask(context.Background(), s.booker, gs, queue, fmt.Sprint("t", i), asynq.NewTask("test:call", payload), false)
		if err != nil || b.askIn > 0 || b.line != nil || b.ready.After(s.clock.Now()) {
			t.Fatalf("task %d: %+v, %v; want it to pass at once", i, b, err)
		}
	}
	// The scripts loaded, the metrics' series made: what every pool shares.
	for i := range 8 {
		book(-1-i, fmt.Appendf(nil, `{"url": "https://warm%d.example/"}`, i))
	}
	pools := keysAtScale(maxKeyedPools)
	h := &heapBound{t: t, what: "keyed pools", baseline: liveHeap(), perKey: 4 << 10}
	start := time.Now()
	var grew int64
	for i := range pools {
		book(i, bigPayload("url", "https://"+longKeyValue(i, ".example")+"/hook"))
		grew = h.check(i+1, pools)
	}
	if n := gs.keyedPools.len(); n != pools+8 && n != maxKeyedPools {
		t.Fatalf("%d keyed pools kept after %d hosts, want every one (at most %d)", n, pools+8, maxKeyedPools)
	}
	t.Logf("%d keyed pools, hosts of %d bytes, payloads of %d bytes: live heap %+.2f MiB (%.0f bytes a pool) in %v",
		pools, maxKeyName, maxKeyedPayload, float64(grew)/(1<<20), float64(grew)/float64(pools), time.Since(start).Round(time.Second))
}

// book books a fresh task with payload; parked says whether it must wait
// in its tenant's line (its tenant holds its share) or book a turn.
func (f *fairFixture) book(t *testing.T, id string, payload []byte, parked bool) {
	t.Helper()
	b, err := bookTask(context.Background(), f.s.booker, f.s.gates.Load(), f.queue, id, asynq.NewTask("test:call", payload), false)
	if err != nil || (b.line != nil) != parked || (!parked && b.askIn > 0) {
		t.Fatalf("task %s: %+v, %v; want it parked: %v", id, b, err, parked)
	}
}

// tenants books a first task for each of n tenants (small payloads),
// behind tasks of another one's whose turns fill the lead (due that soon,
// they no longer count): each then holds a turn of the drain ahead, and
// its next task, with n tenants holding turns, is over its share.
func (f *fairFixture) tenants(t *testing.T, n int, tenant func(int) string) {
	g := f.gate()
	for i := range int(int64(g.limit)*int64(g.lead())/int64(g.period)) + 1 {
		f.book(t, fmt.Sprint("lead-", i), []byte(`{"tenant": "lead"}`), false)
	}
	for i := range n {
		f.book(t, fmt.Sprint("first-", i), fmt.Appendf(nil, `{"tenant": %q}`, tenant(i)), false)
	}
}

// TestParkedViewsMemory (issue 19): a fair queue's worker remembers, for
// a second, the tenants refused their share (maxParkedViews at most).
// With payloads of 1 MiB and tenants of maxKeyName bytes, the live heap
// grows at most 1 KiB per view (plus 2 MiB): the views keep copies of the
// key values, not the payloads (1 MiB each before); and the next refusal
// once they have ended takes them all back to within 2 MiB of before.
// With -short or under the race detector it goes through a 128th of the
// views.
func TestParkedViewsMemory(t *testing.T) {
	views := keysAtScale(maxParkedViews)
	// The tenants' first turns over the next 10s, and the fair depth
	// (300ms of the drain) far below one turn per tenant.
	f := newFairFixture(t, views/10, "payload.tenant", nil)
	tenant := func(i int) string { return longKeyValue(i, "") }
	f.tenants(t, views, tenant)
	h := &heapBound{t: t, what: "parked views", baseline: liveHeap(), perKey: 1 << 10}
	start := time.Now()
	var grew int64
	for i := range views {
		f.book(t, fmt.Sprint("second-", i), bigPayload("tenant", tenant(i)), true)
		grew = h.check(i+1, views)
	}
	if n := len(f.gate().parked); n != views {
		t.Fatalf("%d parked views after %d tenants refused, want %d", n, views, views)
	}
	t.Logf("%d parked views, tenants of %d bytes, payloads of %d bytes: live heap %+.2f MiB (%.0f bytes a view) in %v",
		views, maxKeyName, maxKeyedPayload, float64(grew)/(1<<20), float64(grew)/float64(views), time.Since(start).Round(time.Second))

	f.clock.Add(fairParkedView + time.Millisecond)
	f.book(t, "third", fmt.Appendf(nil, `{"tenant": %q}`, tenant(views-1)), true)
	if n := len(f.gate().parked); n != 1 {
		t.Fatalf("%d parked views after they ended and one more refusal, want 1", n)
	}
	if after := liveHeap() - h.baseline; after > heapSlack {
		t.Fatalf("the live heap is %+.2f MiB over before the views once they were swept, want at most %d MiB", float64(after)/(1<<20), heapSlack>>20)
	}
}

// TestParkedViewsSwept (issue 19): 200 tenants refused their share once
// each; a second later their views have ended, and the next refusal drops
// them (before, a worker kept them until it remembered maxParkedViews).
func TestParkedViewsSwept(t *testing.T) {
	const tenants = 200
	f := newFairFixture(t, 100, "payload.tenant", nil)
	tenant := func(i int) string { return fmt.Sprint("tenant-", i) }
	f.tenants(t, tenants, tenant)
	for i := range tenants {
		f.book(t, fmt.Sprint("second-", i), fmt.Appendf(nil, `{"tenant": %q}`, tenant(i)), true)
	}
	f.clock.Add(fairParkedView + time.Millisecond)
	// Its first turn 2s ahead, among some 100 tenants' still to come.
	f.book(t, "third", fmt.Appendf(nil, `{"tenant": %q}`, tenant(tenants-1)), true)
	if n := len(f.gate().parked); n != 1 {
		t.Fatalf("%d parked views kept after %d ended and one more refusal, want 1: views are kept after they end", n, tenants)
	}
}
