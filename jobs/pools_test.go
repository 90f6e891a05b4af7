package jobs

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/sluicehq/sluice/internal/redistest"
)

// keyedFixture is a Scheduler on Redis's own clock (pools lend only there)
// whose task type test:call draws on one quota keyed by payload.dest.
type keyedFixture struct {
	s            *Scheduler
	queue, quota string
}

func newKeyedFixture(t *testing.T, quota LimitConfig) *keyedFixture {
	t.Helper()
	f := &keyedFixture{queue: redistest.Queue(t, "q"), quota: redistest.Queue(t, "api")}
	quota.Key = "payload.dest"
	f.s = newTestScheduler(t, Config{
		Queues: map[string]QueueConfig{f.queue: {}},
		Quotas: map[string]LimitConfig{f.quota: quota},
		Tasks:  map[string]TaskConfig{"test:call": {Quotas: []string{f.quota}}},
	})
	return f
}

// book books a fresh task for dest, which must pass at once.
func (f *keyedFixture) book(t testing.TB, id, dest string) {
	b, err := bookTask(context.Background(), f.s.booker, f.s.gates.Load(), f.queue, id,
		asynq.NewTask("test:call", fmt.Appendf(nil, `{"dest": %q}`, dest)), false)
	if err != nil || b.askIn > 0 || b.line != nil || b.ready.After(f.s.clock.Now()) {
		t.Errorf("task %s for %s: %+v, %v; want it to pass at once", id, dest, b, err)
	}
}

// counted is how many events dest's bucket counts now.
func (f *keyedFixture) counted(t testing.TB, dest string) int {
	g := f.s.gates.Load().quotas[f.quota]
	if ov := g.overrides.of(dest, true); ov != nil {
		g = ov
	}
	level, err := g.lim.Peek(context.Background(), dest)
	if err != nil {
		t.Fatal(err)
	}
	return g.limit.Burst - level.Remaining
}

// farQuota is far above the tests' load, and so slow to refill (one event
// in 36s) that what a bucket counts stays counted while a test looks. Its
// burst of 600 makes a first lease's 7 untaken events more than a
// hundredth of it: given back when the lease ends (throttle.Pool keeps
// fewer).
func farQuota() LimitConfig {
	return LimitConfig{Algorithm: "token_bucket", Limit: 1000, Period: 10 * time.Hour, Burst: 600}
}

// lent is how many tasks took a turn lent by a pool.
func (f *keyedFixture) lent() int {
	return int(testutil.ToFloat64(f.s.metrics.decisions.WithLabelValues("quota:"+f.quota, "lent")))
}

// TestKeyedQuotaLends (issue 13): fresh tasks of a quota keyed over 10
// values (one with an override of its own), far from its limits, take
// turns lent by their value's pool: hardly any books with a script call of
// its own. What was lent is counted on each value's own bucket.
func TestKeyedQuotaLends(t *testing.T) {
	const values, each = 10, 50
	quota := farQuota()
	quota.Overrides = map[string]LimitOverride{"d0": {Limit: 2000, Burst: 2000}}
	f := newKeyedFixture(t, quota)
	for i := range values * each {
		f.book(t, fmt.Sprint("t", i), fmt.Sprint("d", i%values))
	}
	booked := testutil.ToFloat64(f.s.metrics.bookings.WithLabelValues(f.queue))
	t.Logf("%d tasks on %d key values: %.0f booked, %d lent", values*each, values, booked, f.lent())
	if perTask := booked / (values * each); perTask > 0.1 {
		t.Errorf("%.2f bookings per task (a script call each), want at most 0.1: keyed tasks far from their limits are not lent turns", perTask)
	}
	for v := range values {
		dest := fmt.Sprint("d", v)
		if n := f.counted(t, dest); n < each {
			t.Errorf("%s's bucket counts %d events, want at least its %d tasks", dest, n, each)
		}
	}
}

// TestLeasesCounted: the script runs that lend turns are counted in
// sluice_gate_evaluations_total, as bookings are; they cost Redis as much.
// 10 key values, 50 tasks each: each value's pool leases at least once,
// and far fewer times than it has tasks.
func TestLeasesCounted(t *testing.T) {
	const values, each = 10, 50
	f := newKeyedFixture(t, farQuota())
	for i := range values * each {
		f.book(t, fmt.Sprint("t", i), fmt.Sprint("d", i%values))
	}
	gate := "quota:" + f.quota
	booked := testutil.ToFloat64(f.s.metrics.bookings.WithLabelValues(f.queue))
	runs := testutil.ToFloat64(f.s.metrics.evaluations.WithLabelValues(gate)) - booked
	t.Logf("%d tasks: %d lent, %.0f booked, %.0f other script runs of %s", values*each, f.lent(), booked, runs, gate)
	if runs < values {
		t.Errorf("%.0f script runs of %s besides bookings, want at least one lease per key value (%d): leases go uncounted", runs, gate, values)
	}
	if runs > values*each/4 {
		t.Errorf("%.0f script runs of %s besides bookings for %d tasks, want far fewer: turns are not lent", runs, gate, values*each)
	}
}

// TestKeyedPoolsBounded (issue 13): 10,000 key values, a task each, from
// 32 callers at once: every task is lent a turn, the gate set keeps at
// most maxKeyedPools pools, and once the leases are over (given back when
// their pool is evicted or their span ends) each value's bucket counts
// exactly its one task.
func TestKeyedPoolsBounded(t *testing.T) {
	const values, callers = 10_000, 32
	f := newKeyedFixture(t, farQuota())
	var wg sync.WaitGroup
	for c := range callers {
		wg.Go(func() {
			for v := c; v < values; v += callers {
				f.book(t, fmt.Sprint("t", v), fmt.Sprint("d", v))
			}
		})
	}
	wg.Wait()
	if lent := f.lent(); lent < values*9/10 {
		t.Fatalf("%d of %d tasks lent a turn, want nearly all: keyed gates far from their limits do not lend", lent, values)
	}
	if n := f.s.gates.Load().keyedPools.len(); n > maxKeyedPools {
		t.Fatalf("%d keyed pools kept, want at most %d", n, maxKeyedPools)
	}
	deadline := time.Now().Add(3 * time.Second)
	for v := 0; v < values; v += 7 {
		dest := fmt.Sprint("d", v)
		for f.counted(t, dest) != 1 && time.Now().Before(deadline) {
			time.Sleep(20 * time.Millisecond)
		}
		if n := f.counted(t, dest); n != 1 {
			t.Fatalf("%s's bucket counts %d events after its lease, want its one task: the lease was not given back", dest, n)
		}
	}
}

// TestEvictedPoolGivesBack: with room for 4 keyed pools, a fifth value's
// pool evicts the least recently used one, which gives back its lease's
// unused events at once, long before the lease's span (500ms) would.
func TestEvictedPoolGivesBack(t *testing.T) {
	f := newKeyedFixture(t, farQuota())
	f.s.gates.Load().keyedPools.capacity = 4
	start := time.Now()
	for v := range 4 {
		f.book(t, fmt.Sprint("t", v), fmt.Sprint("d", v))
	}
	for v := range 4 {
		if n := f.counted(t, fmt.Sprint("d", v)); n <= 1 {
			t.Fatalf("d%d's bucket counts %d events after its first task, want a lease's (more than 1): keyed tasks are not lent turns", v, n)
		}
	}
	f.book(t, "t0-again", "d0") // d1 is now the least recently used
	f.book(t, "t4", "d4")
	for f.counted(t, "d1") != 1 && time.Since(start) < 400*time.Millisecond {
		time.Sleep(5 * time.Millisecond)
	}
	if n := f.counted(t, "d1"); n != 1 {
		t.Fatalf("evicted d1's bucket counts %d events %v after its lease, want its one task: the evicted pool kept its lease", n, time.Since(start).Round(time.Millisecond))
	}
	if n := f.counted(t, "d0"); n <= 2 {
		t.Errorf("d0, used again before d4 came, counts %d events, want its lease's: it was evicted instead of d1", n)
	}
	if n := f.s.gates.Load().keyedPools.len(); n != 4 {
		t.Errorf("%d keyed pools kept, want 4", n)
	}
}
