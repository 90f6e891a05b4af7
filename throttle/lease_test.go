package throttle_test

import (
	"context"
	"errors"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/algorithms"
	"github.com/sluicehq/sluice/internal/redistest"
	"github.com/sluicehq/sluice/internal/testkit"
	"github.com/sluicehq/sluice/throttle"
)

// countingHook counts the script calls a client sends.
type countingHook struct {
	mu      sync.Mutex
	calls   int
	cancels int // book script runs that give back (op cancel)
}

func (h *countingHook) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *countingHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		h.count(cmd)
		return next(ctx, cmd)
	}
}
func (h *countingHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		for _, cmd := range cmds {
			h.count(cmd)
		}
		return next(ctx, cmds)
	}
}

func (h *countingHook) count(cmd redis.Cmder) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.calls++
	if slices.Contains(cmd.Args(), any(algorithms.OpCancel)) {
		h.cancels++
	}
}

// TestPoolLendsExactly: a drain and a quota far above the load, taken from
// a Pool: most takes make no call to Redis, and the takes, at the instants
// they happen, never exceed either bucket, also when the load goes past
// what the limits admit (the pool then rests and Take says no).
func TestPoolLendsExactly(t *testing.T) {
	// slots: how many slots the two keys lie on, each a script call per
	// lease.
	for name, c := range map[string]struct {
		rdb   redis.UniversalClient
		slots int
	}{"redis": {redistest.Client(t), 1}, "cluster": {redistest.Cluster(t), 2}} {
		rdb := c.rdb
		t.Run(name, func(t *testing.T) {
			hook := &countingHook{}
			rdb.AddHook(hook)
			prefix := redistest.Prefix(t)
			drainSpec := throttle.Spec{Algorithm: throttle.LeakyBucket, Limit: 400, Period: time.Second, Burst: 200}
			quotaSpec := throttle.Spec{Algorithm: throttle.TokenBucket, Limit: 300, Period: time.Second, Burst: 150}
			drain, err := throttle.New(rdb, drainSpec, throttle.WithPrefix(prefix+"drain:"))
			if err != nil {
				t.Fatal(err)
			}
			quota, err := throttle.New(rdb, quotaSpec, throttle.WithPrefix(prefix+"quota:"))
			if err != nil {
				t.Fatal(err)
			}
			pool, err := throttle.NewPool([]throttle.Claim{{Limiter: drain, Key: "q", N: 1}, {Limiter: quota, Key: "api", N: 1}})
			if err != nil {
				t.Fatal(err)
			}
			defer pool.Close()
			claims := []throttle.Claim{{Limiter: drain, Key: "q", N: 1}, {Limiter: quota, Key: "api", N: 1}}
			var taken []event
			ctx := context.Background()
			// take takes from the pool, or else books as a caller would.
			take := func() {
				ok, err := pool.Take(ctx)
				if err != nil {
					t.Fatal(err)
				}
				if !ok {
					b, err := throttle.Book(ctx, claims, time.Time{}, 0)
					if err != nil {
						t.Fatal(err)
					}
					ok = b.OK
				}
				if ok {
					taken = append(taken, event{time.Now().UnixMicro(), 1})
				}
			}
			// Far below the limits (100/s): leases serve nearly every take.
			for range 100 {
				take()
				time.Sleep(10 * time.Millisecond)
			}
			calls := hook.calls
			t.Logf("below the limits: %d takes with %d Redis commands", len(taken), calls)
			// A lease serves up to its span (250ms here, half the drain's
			// window): about 6 leases with the first small ones, and some
			// give back their tail.
			if most := 15 * c.slots; len(taken) != 100 || calls > most {
				t.Errorf("below the limits: %d of 100 takes allowed with %d Redis commands, want all with at most %d", len(taken), calls, most)
			}
			// Then past them (up to 2,000/s): the limits still hold.
			for start := time.Now(); time.Since(start) < time.Second; time.Sleep(500 * time.Microsecond) {
				take()
			}
			// The instants of the takes, on this process's clock: the limits
			// hold on any clock that runs with theirs.
			for _, spec := range []throttle.Spec{drainSpec, quotaSpec} {
				if err := conforms(spec, taken); err != nil {
					t.Errorf("%s: %v", spec.Algorithm, err)
				}
			}
		})
	}
}

// TestPoolSizesToUse: a pool whose leases end by their span (20ms here,
// half the bucket's window), 3 takes used of each, leases 3 next, not the
// first lease's 8: a lease that hands out all it holds gives nothing back,
// so 20 such rounds cost about one Redis command each, where leases of 8
// cost two (the lease and its tail given back).
func TestPoolSizesToUse(t *testing.T) {
	rdb := redistest.Client(t)
	hook := &countingHook{}
	rdb.AddHook(hook)
	lim, err := throttle.New(rdb, throttle.Spec{Algorithm: throttle.TokenBucket, Limit: 1000, Period: time.Second, Burst: 40},
		throttle.WithPrefix(redistest.Prefix(t)))
	if err != nil {
		t.Fatal(err)
	}
	pool, err := throttle.NewPool([]throttle.Claim{{Limiter: lim, Key: "k", N: 1}})
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	const rounds = 20
	for range rounds {
		for range 3 {
			if ok, err := pool.Take(context.Background()); !ok || err != nil {
				t.Fatalf("Take = %v, %v; want a lent event, far below the limit", ok, err)
			}
		}
		time.Sleep(60 * time.Millisecond) // the lease's span ends
	}
	hook.mu.Lock()
	defer hook.mu.Unlock()
	if most := rounds + rounds/4; hook.calls > most {
		t.Errorf("%d rounds of 3 takes cost %d Redis commands, want at most %d: leases are not sized to what the last one served", rounds, hook.calls, most)
	}
}

// TestPoolNeedsRoom: a leaky bucket of burst 1 spaces events exactly: it
// cannot lend any ahead; a token bucket of 2/s burst 2 could lend one
// event a lease, which saves no round trip (a lease is one, as a Book
// is) and holds its event half a second ahead: NewPool says no to both.
func TestPoolNeedsRoom(t *testing.T) {
	for _, spec := range []throttle.Spec{
		{Algorithm: throttle.LeakyBucket, Limit: 25, Period: time.Second, Burst: 1},
		{Algorithm: throttle.TokenBucket, Limit: 2, Period: time.Second, Burst: 2},
	} {
		lim, err := throttle.New(redistest.Client(t), spec)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := throttle.NewPool([]throttle.Claim{{Limiter: lim, Key: "q", N: 1}}); !errors.Is(err, throttle.ErrNoLease) {
			t.Errorf("NewPool on %d/%v burst %d: %v, want ErrNoLease", spec.Limit, spec.Period, spec.Burst, err)
		}
	}
}

// TestPoolKeepsFewUnused: a lease's unused takes are given back when its
// span ends (a round trip) only if they are worth it: more than a tenth of
// the lease and more than a hundredth of the bucket's burst. Far from its
// limit (burst 20,000), a load that leaves some of each lease unused costs
// no give-back; near it (burst 40), the same load's are given back.
func TestPoolKeepsFewUnused(t *testing.T) {
	for _, c := range []struct {
		burst    int
		giveBack bool
	}{{20_000, false}, {40, true}} {
		rdb := redistest.Client(t)
		hook := &countingHook{}
		rdb.AddHook(hook)
		// A window of 200ms either way: a span of 197ms at burst 20,000
		// (a full lease takes 2.56ms of it), 100ms at burst 40.
		lim, err := throttle.New(rdb, throttle.Spec{Algorithm: throttle.TokenBucket, Limit: 100 * c.burst, Period: 20 * time.Second, Burst: c.burst},
			throttle.WithPrefix(redistest.Prefix(t)))
		if err != nil {
			t.Fatal(err)
		}
		var runs atomic.Int64 // what the pool reports of its script runs
		pool, err := throttle.NewPool([]throttle.Claim{{Limiter: lim, Key: "k", N: 1}}, throttle.OnScriptRun(func() { runs.Add(1) }))
		if err != nil {
			t.Fatal(err)
		}
		// Rounds of 6 takes and of 1: the leases sized to one round leave
		// takes unused in the next.
		for round := range 10 {
			for range 1 + 5*(round%2) {
				if ok, err := pool.Take(context.Background()); !ok || err != nil {
					t.Fatalf("burst %d: Take = %v, %v; want a lent event, far below the limit", c.burst, ok, err)
				}
			}
			time.Sleep(220 * time.Millisecond) // the lease's span ends
		}
		pool.Close()
		hook.mu.Lock()
		cancels, calls := hook.cancels, hook.calls
		hook.mu.Unlock()
		t.Logf("burst %d: %d give-backs in 10 rounds; %d script runs reported, %d commands sent", c.burst, cancels, runs.Load(), calls)
		if gave := cancels > 0; gave != c.giveBack {
			t.Errorf("burst %d: %d give-backs of unused takes; want any: %v", c.burst, cancels, c.giveBack)
		}
		// A lease a round (each outlives its span), and every give-back.
		if n := runs.Load(); n < 10+int64(cancels) || n > int64(calls) {
			t.Errorf("burst %d: OnScriptRun reported %d runs, want from 10 leases + %d give-backs to the %d commands sent", c.burst, n, cancels, calls)
		}
	}
}

// TestPoolSpansRoomyWindow: a bucket whose window (Burst × Period / Limit)
// holds more than a full lease's events lends for more than half of it: a
// key value with a few takes a second (a keyed quota's) is served by one
// lease a second, not two (a 2s window at 200/s: a span of 1s, the most,
// leaves room for leases of 200). The takes still never exceed the
// bucket, also when the load goes past it.
func TestPoolSpansRoomyWindow(t *testing.T) {
	rdb := redistest.Client(t)
	spec := throttle.Spec{Algorithm: throttle.TokenBucket, Limit: 200, Period: time.Second, Burst: 400}
	lim, err := throttle.New(rdb, spec, throttle.WithPrefix(redistest.Prefix(t)))
	if err != nil {
		t.Fatal(err)
	}
	var runs atomic.Int64
	pool, err := throttle.NewPool([]throttle.Claim{{Limiter: lim, Key: "k", N: 1}}, throttle.OnScriptRun(func() { runs.Add(1) }))
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	ctx := context.Background()
	var taken []event
	// take takes from the pool, or else books as a caller would.
	take := func() {
		ok, err := pool.Take(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if !ok {
			b, err := throttle.Book(ctx, []throttle.Claim{{Limiter: lim, Key: "k", N: 1}}, time.Time{}, 0)
			if err != nil {
				t.Fatal(err)
			}
			ok = b.OK
		}
		if ok {
			taken = append(taken, event{time.Now().UnixMicro(), 1})
		}
	}
	// 4 takes 250ms apart: one lease.
	for i := range 4 {
		if i > 0 {
			time.Sleep(250 * time.Millisecond)
		}
		take()
	}
	if n := runs.Load(); len(taken) != 4 || n != 1 {
		t.Errorf("4 takes over 750ms: %d lent with %d script runs; want all 4 from one lease", len(taken), n)
	}
	// Then past the limit (a take every 250µs or so, for 2s).
	for start := time.Now(); time.Since(start) < 2*time.Second; time.Sleep(250 * time.Microsecond) {
		take()
	}
	if err := conforms(spec, taken); err != nil {
		t.Error(err)
	}
	t.Logf("%d takes admitted, %d script runs of the pool", len(taken), runs.Load())
}

// TestPoolOnManualClock: a Pool and its limiter on one clock that the test
// moves by hand lend as on the system's: a lease serves 8 takes with one
// script run, is spent and followed by a twice larger one; its span ends
// when the clock passes it, not when the wall clock does (the next take
// leases anew), and its unused takes are given back then.
func TestPoolOnManualClock(t *testing.T) {
	clock := testkit.NewClock(time.Unix(1_800_000_000, 0))
	rdb := redistest.Client(t)
	hook := &countingHook{}
	rdb.AddHook(hook)
	// A window of 1s: a span of 500ms, leases of up to 50 takes.
	lim, err := throttle.New(rdb, throttle.Spec{Algorithm: throttle.TokenBucket, Limit: 100, Period: time.Second, Burst: 100},
		throttle.WithPrefix(redistest.Prefix(t)), throttle.WithClock(clock))
	if err != nil {
		t.Fatal(err)
	}
	var runs atomic.Int64
	pool, err := throttle.NewPool([]throttle.Claim{{Limiter: lim, Key: "k", N: 1}},
		throttle.OnScriptRun(func() { runs.Add(1) }), throttle.PoolClock(clock))
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	take := func(want bool) {
		t.Helper()
		if ok, err := pool.Take(context.Background()); ok != want || err != nil {
			t.Fatalf("Take at %v = %v, %v; want %v", clock.Now(), ok, err, want)
		}
	}
	for range 8 {
		take(true)
	}
	if n := runs.Load(); n != 1 {
		t.Fatalf("8 takes made %d script runs, want 1 lease", n)
	}
	take(true) // the first lease is spent: the next is of 16
	if n := runs.Load(); n != 2 {
		t.Fatalf("the 9th take made %d script runs in all, want 2 leases", n)
	}
	// The wall clock runs past the span; the pool's clock does not.
	time.Sleep(600 * time.Millisecond)
	take(true)
	if n := runs.Load(); n != 2 {
		t.Fatalf("a take within the span on the pool's clock made %d script runs in all, want still 2", n)
	}
	if clock.Waiting() == 0 {
		t.Fatal("no give-back waits on the pool's clock")
	}
	// Past the span on the pool's clock: the 14 unused takes are given
	// back, once.
	clock.Add(600 * time.Millisecond)
	testkit.WaitFor(t, 5*time.Second, "the unused takes to be given back", func() bool { return runs.Load() == 3 })
	hook.mu.Lock()
	cancels := hook.cancels
	hook.mu.Unlock()
	if cancels != 1 {
		t.Fatalf("%d give-backs, want 1", cancels)
	}
	take(true) // a new lease
	if n := runs.Load(); n != 4 {
		t.Fatalf("a take after the span made %d script runs in all, want 4 (2 leases, a give-back, a lease)", n)
	}
}
