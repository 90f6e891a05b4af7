package throttle_test

import (
	"context"
	"errors"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sluicehq/sluice/internal/testkit"
	"github.com/sluicehq/sluice/throttle"
)

const ms = time.Millisecond

// step is one call at t0+at and the decision it must get.
type step struct {
	at   time.Duration
	n    int
	want throttle.Decision
}

func allowed(remaining int, reset time.Duration) throttle.Decision {
	return throttle.Decision{Allowed: true, Remaining: remaining, ResetAfter: reset}
}

func denied(remaining int, retry, reset time.Duration) throttle.Decision {
	return throttle.Decision{Remaining: remaining, RetryAfter: retry, ResetAfter: reset}
}

// run walks steps through lim on one key and checks every decision.
func run(t *testing.T, lim throttle.Limiter, clock *testkit.Clock, steps []step) {
	t.Helper()
	for i, s := range steps {
		clock.Set(t0.Add(s.at))
		if got := allow(t, lim, "k", s.n); got != s.want {
			t.Errorf("step %d: AllowN(n=%d) at +%v = %+v, want %+v", i, s.n, s.at, got, s.want)
		}
	}
}

// Five events per second; sliding_counter in sub-windows of 200ms.
var fivePerSecond = throttle.Spec{Limit: 5, Period: time.Second, Windows: 5}

// fivePerSecondOn is mustLimiter of algorithm a at fivePerSecond.
func fivePerSecondOn(t *testing.T, e engine, a throttle.Algorithm) (throttle.Reserver, *testkit.Clock) {
	t.Helper()
	spec := fivePerSecond
	spec.Algorithm = a
	return mustLimiter(t, e, spec)
}

// bucketSteps holds for both buckets: a token bucket's tokens are a leaky
// bucket's free space.
var bucketSteps = []step{
	{0, 5, allowed(0, 1000*ms)},
	{0, 1, denied(0, 200*ms, 1000*ms)},
	{100 * ms, 1, denied(0, 100*ms, 900*ms)},
	{198 * ms, 1, denied(0, 2*ms, 802*ms)},
	{200 * ms, 1, allowed(0, 1000*ms)},
	{700 * ms, 3, denied(2, 100*ms, 500*ms)},
	{800 * ms, 3, allowed(0, 1000*ms)},
	{2000 * ms, 5, allowed(0, 1000*ms)},
}

// slidingSteps holds for sliding_log and, with sub-windows of 200ms that
// these instants fall on, for sliding_counter.
var slidingSteps = []step{
	{0, 1, allowed(4, 1000*ms)},
	{0, 3, allowed(1, 1000*ms)},
	{400 * ms, 2, denied(1, 600*ms, 600*ms)},
	{400 * ms, 1, allowed(0, 1000*ms)},
	{998 * ms, 1, denied(0, 2*ms, 402*ms)},
	{1000 * ms, 1, allowed(3, 1000*ms)},
	{1000 * ms, 4, denied(3, 400*ms, 1000*ms)},
	{1399 * ms, 4, denied(3, 1*ms, 601*ms)},
	{1400 * ms, 4, allowed(0, 1000*ms)},
}

var stepsByAlgorithm = map[throttle.Algorithm][]step{
	throttle.FixedWindow: {
		{0, 1, allowed(4, 1000*ms)},
		{0, 3, allowed(1, 1000*ms)},
		{400 * ms, 2, denied(1, 600*ms, 600*ms)},
		{400 * ms, 1, allowed(0, 600*ms)},
		{998 * ms, 1, denied(0, 2*ms, 2*ms)},
		// A new window: the fixed window admits a full Limit at once.
		{1000 * ms, 5, allowed(0, 1000*ms)},
		{1500 * ms, 1, denied(0, 500*ms, 500*ms)},
	},
	throttle.SlidingLog:     slidingSteps,
	throttle.SlidingCounter: slidingSteps,
	throttle.TokenBucket:    bucketSteps,
	throttle.LeakyBucket:    bucketSteps,
}

func TestDecisions(t *testing.T) {
	forEach(t, func(t *testing.T, e engine, a throttle.Algorithm) {
		lim, clock := fivePerSecondOn(t, e, a)
		run(t, lim, clock, stepsByAlgorithm[a])
	})
}

func TestLeakyBucketBurstOneSpacesEvents(t *testing.T) {
	for _, e := range engines(t) {
		t.Run(e.name, func(t *testing.T) {
			lim, clock := mustLimiter(t, e, throttle.Spec{Algorithm: throttle.LeakyBucket, Limit: 5, Period: time.Second, Burst: 1})
			run(t, lim, clock, []step{
				{0, 1, allowed(0, 200*ms)},
				{100 * ms, 1, denied(0, 100*ms, 100*ms)},
				{200 * ms, 1, allowed(0, 200*ms)},
				{399 * ms, 1, denied(0, 1*ms, 1*ms)},
				{400 * ms, 1, allowed(0, 200*ms)},
			})
		})
	}
}

// TestRetryAfterIsExact walks random timelines and, at every denial, checks
// that the same call is still denied 2ms before RetryAfter (which must
// consume nothing) and allowed at RetryAfter.
func TestRetryAfterIsExact(t *testing.T) {
	forEach(t, func(t *testing.T, e engine, a throttle.Algorithm) {
		rng := rand.New(rand.NewPCG(1, uint64(len(a))))
		spec := throttle.Spec{Algorithm: a, Limit: 7, Period: 700 * ms, Burst: 4, Windows: 7}
		lim, clock := mustLimiter(t, e, spec)
		capacity := spec.Limit
		if a == throttle.TokenBucket || a == throttle.LeakyBucket {
			capacity = spec.Burst
		}
		now, denials := t0, 0
		for i := 0; i < 120; i++ {
			now = now.Add(time.Duration(rng.IntN(90)) * ms)
			n := 1 + rng.IntN(capacity)
			clock.Set(now)
			d := allow(t, lim, "k", n)
			if d.Allowed {
				continue
			}
			denials++
			if d.RetryAfter <= 0 {
				t.Fatalf("call %d: denied with RetryAfter %v", i, d.RetryAfter)
			}
			early := d.RetryAfter - 2*ms
			if early <= 0 {
				early = d.RetryAfter - time.Microsecond
			}
			clock.Set(now.Add(early))
			if got := allow(t, lim, "k", n); got.Allowed {
				t.Fatalf("call %d: n=%d allowed %v after a denial with RetryAfter %v", i, n, early, d.RetryAfter)
			}
			now = now.Add(d.RetryAfter)
			clock.Set(now)
			if got := allow(t, lim, "k", n); !got.Allowed {
				t.Fatalf("call %d: n=%d denied at RetryAfter %v: %+v", i, n, d.RetryAfter, got)
			}
		}
		if denials < 10 {
			t.Fatalf("the timeline met only %d denials; it tests too little", denials)
		}
	})
}

// TestDeniedCallsConsumeNothing hammers a full key: at later instants it
// must get the same decisions as a key that was filled the same way and
// then left alone.
func TestDeniedCallsConsumeNothing(t *testing.T) {
	forEach(t, func(t *testing.T, e engine, a throttle.Algorithm) {
		lim, clock := fivePerSecondOn(t, e, a)
		allow(t, lim, "hammered", 5)
		allow(t, lim, "quiet", 5)
		for i := 0; i < 200; i++ {
			clock.Set(t0.Add(time.Duration(i) * ms))
			if d := allow(t, lim, "hammered", 1+i%5); d.Allowed {
				t.Fatalf("call %d allowed on a full key: %+v", i, d)
			}
		}
		for _, at := range []time.Duration{250 * ms, 1000 * ms} {
			clock.Set(t0.Add(at))
			if got, want := allow(t, lim, "hammered", 1), allow(t, lim, "quiet", 1); got != want {
				t.Errorf("at +%v after 200 denied calls: %+v, without them: %+v", at, got, want)
			}
		}
	})
}

// TestConcurrentCallersAdmitExactlyTheLimit: 50 callers at one instant.
func TestConcurrentCallersAdmitExactlyTheLimit(t *testing.T) {
	forEach(t, func(t *testing.T, e engine, a throttle.Algorithm) {
		lim, _ := mustLimiter(t, e, throttle.Spec{Algorithm: a, Limit: 20, Period: time.Second})
		var admitted atomic.Int64
		var wg sync.WaitGroup
		for i := 0; i < 50; i++ {
			wg.Go(func() {
				for j := 0; j < 3; j++ {
					d, err := lim.AllowN(context.Background(), "k", 1)
					if err != nil {
						t.Error(err)
						return
					}
					if d.Allowed {
						admitted.Add(1)
					}
				}
			})
		}
		wg.Wait()
		if got := admitted.Load(); got != 20 {
			t.Fatalf("150 calls at one instant admitted %d, want exactly the limit 20", got)
		}
	})
}

func TestInvalidSpec(t *testing.T) {
	valid := func(a throttle.Algorithm) throttle.Spec {
		return throttle.Spec{Algorithm: a, Limit: 10, Period: time.Second}
	}
	cases := []struct {
		desc  string
		spec  throttle.Spec
		opts  []throttle.Option
		field string
	}{
		{"unknown algorithm", throttle.Spec{Algorithm: "gcra", Limit: 1, Period: time.Second}, nil, "Spec.Algorithm"},
		{"no algorithm", throttle.Spec{Limit: 1, Period: time.Second}, nil, "Spec.Algorithm"},
		{"zero limit", throttle.Spec{Algorithm: throttle.TokenBucket, Period: time.Second}, nil, "Spec.Limit"},
		{"negative limit", throttle.Spec{Algorithm: throttle.FixedWindow, Limit: -3, Period: time.Second}, nil, "Spec.Limit"},
		{"zero period", throttle.Spec{Algorithm: throttle.SlidingLog, Limit: 1}, nil, "Spec.Period"},
		{"period under 1ms", throttle.Spec{Algorithm: throttle.SlidingLog, Limit: 1, Period: 999 * time.Microsecond}, nil, "Spec.Period"},
		{"period not whole µs", throttle.Spec{Algorithm: throttle.LeakyBucket, Limit: 1, Period: time.Second + 1}, nil, "Spec.Period"},
		{"negative burst", throttle.Spec{Algorithm: throttle.TokenBucket, Limit: 1, Period: time.Second, Burst: -1}, nil, "Spec.Burst"},
		{"burst beyond exact arithmetic", throttle.Spec{Algorithm: throttle.LeakyBucket, Limit: 1, Period: time.Hour, Burst: 1 << 22}, nil, "Spec.Burst"},
		{"negative windows", throttle.Spec{Algorithm: throttle.SlidingCounter, Limit: 1, Period: time.Second, Windows: -1}, nil, "Spec.Windows"},
		{"windows not dividing period", throttle.Spec{Algorithm: throttle.SlidingCounter, Limit: 1, Period: time.Second, Windows: 7}, nil, "Spec.Windows"},
		{"too many windows", throttle.Spec{Algorithm: throttle.SlidingCounter, Limit: 1, Period: time.Hour, Windows: 3600}, nil, "Spec.Windows"},
		{"prefix with a brace", valid(throttle.FixedWindow), []throttle.Option{throttle.WithPrefix("a{b}:")}, "WithPrefix"},
	}
	for _, e := range engines(t) {
		for _, c := range cases {
			t.Run(e.name+"/"+c.desc, func(t *testing.T) {
				_, err := e.new(c.spec, c.opts...)
				if !errors.Is(err, throttle.ErrInvalidSpec) {
					t.Fatalf("err = %v, want ErrInvalidSpec", err)
				}
				if !strings.Contains(err.Error(), c.field) {
					t.Fatalf("err = %q, want it to name %s", err, c.field)
				}
			})
		}
	}
}

func TestInvalidCost(t *testing.T) {
	forEach(t, func(t *testing.T, e engine, a throttle.Algorithm) {
		lim, _ := mustLimiter(t, e, throttle.Spec{Algorithm: a, Limit: 10, Period: time.Second, Burst: 4})
		capacity := 10
		if a == throttle.TokenBucket || a == throttle.LeakyBucket {
			capacity = 4
		}
		for _, n := range []int{0, -1, capacity + 1} {
			_, err := lim.AllowN(context.Background(), "k", n)
			if !errors.Is(err, throttle.ErrInvalidCost) {
				t.Fatalf("AllowN(n=%d): err = %v, want ErrInvalidCost", n, err)
			}
			if !strings.Contains(err.Error(), "n") {
				t.Fatalf("AllowN(n=%d): err = %q does not name n", n, err)
			}
		}
		if d := allow(t, lim, "k", capacity); !d.Allowed {
			t.Fatalf("AllowN(n=%d) on a fresh key denied: %+v", capacity, d)
		}
	})
}
