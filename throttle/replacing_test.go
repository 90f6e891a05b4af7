package throttle_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/sluicehq/sluice/internal/redistest"
	"github.com/sluicehq/sluice/internal/testkit"
	"github.com/sluicehq/sluice/throttle"
)

// TestReplacingKeepsWhatWasUsed (issue 20.4), on every engine and
// algorithm: a key of a limit of 2 per second used once now and booked
// once 400 ms ahead; 100 ms later a limiter Replacing it takes over.
// Raised to 10 per second: sliding_log and sliding_counter have 9 left of
// 10 (the turn ahead is not taken over: its caller books it again),
// fixed_window 8 (the turn is in the current window), the buckets 1 (the
// old bucket's 0.9 s of server time ahead, turn included, in the new 1 s
// window); a fresh key 10. Cut to 1 per second: refused for 900 ms, until
// the old events have passed; a fresh key allowed. A block is taken over;
// another algorithm's state is refused.
func TestReplacingKeepsWhatWasUsed(t *testing.T) {
	ctx := context.Background()
	forEach(t, func(t *testing.T, e engine, a throttle.Algorithm) {
		for _, cut := range []bool{false, true} {
			old, clock := mustLimiter(t, e, throttle.Spec{Algorithm: a, Limit: 2, Period: time.Second, Burst: 2})
			k := fmt.Sprint("k", cut) // the engine's prefix is the test's
			if d := allow(t, old, k, 1); !d.Allowed {
				t.Fatalf("first event refused: %+v", d)
			}
			if r, err := old.ReserveAfter(ctx, k, 1, clock.Now().Add(400*time.Millisecond), time.Second); err != nil || !r.OK {
				t.Fatalf("a turn 400 ms ahead: %+v, %v", r, err)
			}
			if err := old.Block(ctx, k+"blocked", 5*time.Second); err != nil {
				t.Fatal(err)
			}
			clock.Add(100 * time.Millisecond)
			spec := throttle.Spec{Algorithm: a, Limit: 10, Period: time.Second, Burst: 10}
			if cut {
				spec.Limit, spec.Burst = 1, 1
			}
			// A state of its own, as a changed limit has (a prefix the
			// local engine ignores).
			lim, err := e.new(spec, throttle.WithClock(clock), throttle.Replacing(old), throttle.WithPrefix(redistest.Prefix(t)))
			if err != nil {
				t.Fatal(err)
			}
			if d := allow(t, lim, k+"blocked", 1); d.Allowed || d.RetryAfter != 4900*time.Millisecond {
				t.Errorf("a key blocked for 5 s under the old limit, 100 ms on: %+v, want refused for 4.9s", d)
			}
			if cut {
				if d := allow(t, lim, k, 1); d.Allowed || d.RetryAfter != 900*time.Millisecond {
					t.Errorf("cut to 1/s: %+v, want refused for 900ms", d)
				}
				if d := allow(t, lim, "fresh", 1); !d.Allowed {
					t.Errorf("cut to 1/s: a fresh key refused: %+v", d)
				}
				continue
			}
			want := map[throttle.Algorithm]int{throttle.SlidingLog: 9, throttle.SlidingCounter: 9, throttle.FixedWindow: 8, throttle.TokenBucket: 1, throttle.LeakyBucket: 1}[a]
			for key, room := range map[string]int{k: want, "fresh": 10} {
				if level, err := lim.Peek(ctx, key); err != nil || level.Remaining != room {
					t.Errorf("raised to 10/s: key %q has room %d (%v), want %d", key, level.Remaining, err, room)
				}
			}
		}
		other := throttle.SlidingLog
		if a == throttle.SlidingLog {
			other = throttle.TokenBucket
		}
		old, _ := mustLimiter(t, e, throttle.Spec{Algorithm: a, Limit: 2, Period: time.Second})
		if _, err := e.new(throttle.Spec{Algorithm: other, Limit: 2, Period: time.Second}, throttle.Replacing(old)); !errors.Is(err, throttle.ErrInvalidSpec) {
			t.Errorf("a %s limiter Replacing a %s one: %v, want ErrInvalidSpec", other, a, err)
		}
	})
}

// TestReplacingMatchesLocal runs seeded random timelines through a Redis
// engine and the local engine side by side, under a random spec and then
// under another of the same algorithm that replaces it (raised or cut,
// period, burst and sub-windows too): every decision must be the same,
// on keys used before the change and on keys first used after it.
func TestReplacingMatchesLocal(t *testing.T) {
	t.Parallel() // on a manual clock: it runs beside the package's other tests
	ctx := context.Background()
	for _, e := range engines(t)[1:] {
		for _, a := range throttle.Algorithms {
			t.Run(e.name+"/"+string(a), func(t *testing.T) {
				for seed := uint64(1); seed <= 12; seed++ {
					rng := rand.New(rand.NewPCG(seed, uint64(len(a))+100))
					clock := testkit.NewClock(t0.Add(time.Duration(rng.Int64N(int64(time.Hour)))))
					var pair [2]throttle.Reserver // local, redis
					keys := []string{"a", "b{c}", "user:42", "late"}
					for phase, spec := range []throttle.Spec{randomSpec(rng, a), randomSpec(rng, a)} {
						localOpts := []throttle.Option{throttle.WithClock(clock)}
						remoteOpts := []throttle.Option{throttle.WithClock(clock), throttle.WithPrefix(redistest.Prefix(t))}
						if phase > 0 {
							localOpts = append(localOpts, throttle.Replacing(pair[0]))
							remoteOpts = append(remoteOpts, throttle.Replacing(pair[1]))
						}
						local, err := throttle.NewLocal(spec, localOpts...)
						if err != nil {
							t.Fatal(err)
						}
						remote, err := throttle.New(e.rdb, spec, remoteOpts...)
						if err != nil {
							t.Fatal(err)
						}
						pair = [2]throttle.Reserver{local, remote}
						for i := range 100 {
							clock.Add(time.Duration(rng.Int64N(int64(spec.Period) / int64(spec.Limit))))
							key, n, op := keys[rng.IntN(len(keys)-1+phase)], 1+rng.IntN(capacityOf(spec)), rng.IntN(10)
							var got [2]string
							for j, r := range pair {
								switch {
								case op < 5:
									d, err := r.AllowN(ctx, key, n)
									got[j] = fmt.Sprintf("AllowN %+v %v", d, err)
								case op < 8:
									res, err := r.ReserveAfter(ctx, key, n, time.Time{}, spec.Period)
									got[j] = fmt.Sprintf("ReserveAfter %+v %v", res, err)
								case op == 8:
									got[j] = fmt.Sprint("Block ", r.Block(ctx, key, spec.Period/3))
								default:
									l, err := r.Peek(ctx, key)
									got[j] = fmt.Sprintf("Peek %+v %v", l, err)
								}
							}
							if got[0] != got[1] {
								t.Fatalf("seed %d, phase %d (spec %+v), call %d on %q, n %d: local %s, redis %s", seed, phase, spec, i, key, n, got[0], got[1])
							}
						}
					}
				}
			})
		}
	}
}
