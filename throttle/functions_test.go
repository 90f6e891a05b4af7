package throttle_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/algorithms"
	"github.com/sluicehq/sluice/internal/redistest"
	"github.com/sluicehq/sluice/internal/testkit"
	"github.com/sluicehq/sluice/throttle"
)

// A counter's state as versions before functions wrote it (its numbers
// between spaces, not commas) is read as the state written now: the same
// decisions, call for call, as a limit whose state was never rewritten.
func TestCounterStateOfEarlierVersions(t *testing.T) {
	ctx := context.Background()
	rdb := redistest.Client(t)
	for _, a := range []throttle.Algorithm{throttle.FixedWindow, throttle.SlidingCounter} {
		t.Run(string(a), func(t *testing.T) {
			spec := throttle.Spec{Algorithm: a, Limit: 5, Period: time.Second, Windows: 5}
			clock := testkit.NewClock(t0)
			prefix := redistest.Prefix(t)
			rewritten, fresh := newOn(t, rdb, spec, clock, prefix+"rewritten:"), newOn(t, rdb, spec, clock, prefix+"fresh:")
			var rewrites, denied int
			for i := range 40 {
				clock.Set(t0.Add(time.Duration(i) * 130 * time.Millisecond))
				keys, err := rdb.Keys(ctx, prefix+"rewritten:*").Result()
				if err != nil {
					t.Fatal(err)
				}
				for _, k := range keys {
					state, err := rdb.Get(ctx, k).Result()
					if err != nil {
						t.Fatal(err)
					}
					if strings.Contains(state, ",") {
						rewrites++
					}
					if err := rdb.SetArgs(ctx, k, strings.ReplaceAll(state, ",", " "), redis.SetArgs{KeepTTL: true}).Err(); err != nil {
						t.Fatal(err)
					}
				}
				got, want := allow(t, rewritten, "k", 1), allow(t, fresh, "k", 1)
				if got != want {
					t.Fatalf("call %d at +%v: %+v on the state rewritten with spaces, %+v on the one as written", i, clock.Now().Sub(t0), got, want)
				}
				if !got.Allowed {
					denied++
				}
			}
			if rewrites < 20 || denied == 0 {
				t.Fatalf("%d states with counts rewritten, %d calls denied: the timeline tests too little", rewrites, denied)
			}
		})
	}
}

// A bucket's state as versions before the lean bucket script wrote it,
// "ref blocked count last s e", is read as the one written now, "ref s e":
// the same decisions, call for call, on the FCALL and the EVALSHA paths, as
// a limit whose state was never rewritten.
func TestBucketStateOfEarlierVersions(t *testing.T) {
	ctx := context.Background()
	functions, scripts := redistest.Client(t), redistest.Client(t)
	algorithms.BookScript.ScriptsOnly(scripts)
	for _, rdb := range []*redis.Client{functions, scripts} {
		for _, a := range []throttle.Algorithm{throttle.TokenBucket, throttle.LeakyBucket} {
			t.Run(string(a), func(t *testing.T) {
				spec := throttle.Spec{Algorithm: a, Limit: 5, Period: time.Second, Burst: 3}
				clock := testkit.NewClock(t0)
				prefix := redistest.Prefix(t)
				rewritten, fresh := newOn(t, rdb, spec, clock, prefix+"rewritten:"), newOn(t, rdb, spec, clock, prefix+"fresh:")
				var rewrites, denied int
				for i := range 60 {
					clock.Set(t0.Add(time.Duration(i) * 130 * time.Millisecond))
					keys, err := rdb.Keys(ctx, prefix+"rewritten:*").Result()
					if err != nil {
						t.Fatal(err)
					}
					for _, k := range keys {
						state, err := rdb.Get(ctx, k).Result()
						if err != nil {
							t.Fatal(err)
						}
						v := strings.Fields(state)
						if len(v) != 3 {
							continue // a state the lean script does not write
						}
						old := fmt.Sprintf("%s 0 1 %s %s %s", v[0], v[2], v[1], v[2])
						if err := rdb.SetArgs(ctx, k, old, redis.SetArgs{KeepTTL: true}).Err(); err != nil {
							t.Fatal(err)
						}
						rewrites++
					}
					n := 1 + i%2
					if i%5 == 4 {
						got, err := rewritten.ReserveN(ctx, "k", n, 300*time.Millisecond)
						if err != nil {
							t.Fatal(err)
						}
						want, err := fresh.ReserveN(ctx, "k", n, 300*time.Millisecond)
						if err != nil {
							t.Fatal(err)
						}
						if got != want {
							t.Fatalf("call %d at +%v: ReserveN %+v on the state rewritten as before, %+v on the one as written", i, clock.Now().Sub(t0), got, want)
						}
						continue
					}
					got, want := allow(t, rewritten, "k", n), allow(t, fresh, "k", n)
					if got != want {
						t.Fatalf("call %d at +%v: %+v on the state rewritten as before, %+v on the one as written", i, clock.Now().Sub(t0), got, want)
					}
					if !got.Allowed {
						denied++
					}
				}
				if rewrites < 20 || denied == 0 {
					t.Fatalf("%d states rewritten, %d calls denied: the timeline tests too little", rewrites, denied)
				}
			})
		}
	}
}

// A Redis user that may not call functions (an ACL without FCALL) gets the
// same decisions, from the scripts.
func TestUserWithoutFunctions(t *testing.T) {
	ctx := context.Background()
	admin := redistest.Client(t)
	user := fmt.Sprint("test-nofcall-", time.Now().UnixNano())
	if err := admin.Do(ctx, "ACL", "SETUSER", user, "on", ">pw", "+@all", "-fcall", "-function", "~*", "&*").Err(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { admin.Do(context.Background(), "ACL", "DELUSER", user) })
	rdb := redis.NewClient(&redis.Options{Addr: redistest.Addr(t), Username: user, Password: "pw"})
	t.Cleanup(func() { rdb.Close() })
	spec := throttle.Spec{Algorithm: throttle.TokenBucket, Limit: 3, Period: time.Second}
	clock := testkit.NewClock(t0)
	prefix := redistest.Prefix(t)
	lim := newOn(t, rdb, spec, clock, prefix)
	local, err := throttle.NewLocal(spec, throttle.WithClock(clock))
	if err != nil {
		t.Fatal(err)
	}
	for i := range 10 {
		clock.Set(t0.Add(time.Duration(i) * 100 * time.Millisecond))
		if got, want := allow(t, lim, "k", 1), allow(t, local, "k", 1); got != want {
			t.Fatalf("call %d: %+v, want %+v", i, got, want)
		}
	}
}

func newOn(t *testing.T, rdb redis.UniversalClient, spec throttle.Spec, clock throttle.Clock, prefix string) throttle.Reserver {
	t.Helper()
	lim, err := throttle.New(rdb, spec, throttle.WithClock(clock), throttle.WithPrefix(prefix))
	if err != nil {
		t.Fatal(err)
	}
	return lim
}

// miniredis, the try-out mode's Redis, has no functions: the limits run
// there as scripts, with the reservations of the in-process twin, the
// pieces a Cancel gives back included. (Its Lua computed gcd(limit,
// period) wrong before: a bucket of 4 per 100ms counted an event as 1 µs of
// its time, not 25,000.)
func TestMiniredisBuckets(t *testing.T) {
	ctx := context.Background()
	mini := miniredis.RunT(t)
	rdb := redis.NewClient(&redis.Options{Addr: mini.Addr()})
	t.Cleanup(func() { rdb.Close() })
	for _, a := range []throttle.Algorithm{throttle.TokenBucket, throttle.LeakyBucket} {
		t.Run(string(a), func(t *testing.T) {
			spec := throttle.Spec{Algorithm: a, Limit: 4, Period: 100 * time.Millisecond, Burst: 3}
			clock := testkit.NewClock(t0)
			lim := newOn(t, rdb, spec, clock, redistest.Prefix(t))
			local, err := throttle.NewLocal(spec, throttle.WithClock(clock))
			if err != nil {
				t.Fatal(err)
			}
			waited := 0
			for i := range 40 {
				clock.Set(t0.Add(time.Duration(i) * 10 * time.Millisecond))
				got, err := lim.ReserveN(ctx, "k", 1, 50*time.Millisecond)
				if err != nil {
					t.Fatal(err)
				}
				want, err := local.ReserveN(ctx, "k", 1, 50*time.Millisecond)
				if err != nil {
					t.Fatal(err)
				}
				if got != want {
					t.Fatalf("call %d: %+v, want %+v", i, got, want)
				}
				if got.Delay > 0 {
					waited++
				}
			}
			if waited == 0 {
				t.Fatal("no call waited: the timeline tests too little")
			}
		})
	}
}
