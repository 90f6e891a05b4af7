package throttle_test

import (
	"context"
	_ "embed"
	"fmt"
	"regexp"
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

// A fixed window's state as versions before functions wrote it (its
// numbers between spaces, not commas) is read as the state written now:
// the same decisions, call for call, as a limit whose state was never
// rewritten.
func TestCounterStateOfEarlierVersions(t *testing.T) {
	ctx := context.Background()
	rdb := redistest.Client(t)
	spec := throttle.Spec{Algorithm: throttle.FixedWindow, Limit: 5, Period: time.Second}
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
}

// earlierSlidingCounter is the sliding counter's lean script of the last
// version that wrote the text form "b,i1,c1,..." (with commas; versions
// before functions wrote spaces).
//
//go:embed testdata/allow_counter_5e0f030.lua
var earlierSlidingCounter string

// A sliding counter's state written by an earlier version (the text form,
// by that version's own script, with commas and rewritten with spaces) is
// read after the upgrade, and rewritten in the cumulative form: the same
// decisions, call for call, as the in-process twin, whichever call of the
// timeline the upgrade comes at, on the FCALL and EVALSHA paths. The
// timelines mix AllowN and ReserveN (turns booked sub-windows ahead), so
// that the states upgraded hold sub-windows trimmed, kept and ahead.
func TestSlidingCounterStateOfEarlierVersions(t *testing.T) {
	ctx := context.Background()
	functions, scripts := redistest.Client(t), redistest.Client(t)
	algorithms.BookScript.ScriptsOnly(scripts)
	earlier := redis.NewScript(earlierSlidingCounter)
	spec := throttle.Spec{Algorithm: throttle.SlidingCounter, Limit: 5, Period: time.Second, Windows: 5}
	const calls = 30
	for _, rdb := range []*redis.Client{functions, scripts} {
		var upgraded, denied, ahead int
		for upgrade := range calls {
			clock := testkit.NewClock(t0)
			prefix := redistest.Prefix(t)
			lim := newOn(t, rdb, spec, clock, prefix)
			twin, err := throttle.NewLocal(spec, throttle.WithClock(clock))
			if err != nil {
				t.Fatal(err)
			}
			key := throttle.Key(prefix, "k")
			for i := range calls {
				clock.Set(t0.Add(time.Duration(i) * 130 * time.Millisecond))
				n, maxWait := 1+i%2, time.Duration(0)
				if i%3 == 2 {
					maxWait = 700 * time.Millisecond
				}
				want, err := twin.ReserveN(ctx, "k", n, maxWait)
				if err != nil {
					t.Fatal(err)
				}
				if !want.OK {
					denied++
				} else if want.Delay > 0 {
					ahead++
				}
				if i < upgrade {
					// The earlier version's AllowN or ReserveN: its lean
					// script's KEYS and ARGV (now, sub-window, windows, limit,
					// n, TTL slack, the longest wait).
					reply, err := earlier.Run(ctx, rdb, []string{key}, clock.Now().UnixMicro(), int64(200_000), 5, 5, n, time.Minute.Microseconds(), maxWait.Microseconds()).Slice()
					if err != nil {
						t.Fatal(err)
					}
					if ok, at := reply[0] == int64(1), reply[2].(int64); ok != want.OK || ok && at != want.At.UnixMicro() {
						t.Fatalf("upgrade at call %d: call %d by the earlier version: %v, want %+v", upgrade, i, reply, want)
					}
					if upgrade%2 == 1 {
						state, err := rdb.Get(ctx, key).Result()
						if err != nil {
							t.Fatal(err)
						}
						if err := rdb.SetArgs(ctx, key, strings.ReplaceAll(state, ",", " "), redis.SetArgs{KeepTTL: true}).Err(); err != nil {
							t.Fatal(err)
						}
					}
					continue
				}
				got, err := lim.ReserveN(ctx, "k", n, maxWait)
				if err != nil {
					t.Fatal(err)
				}
				if got != want {
					t.Fatalf("upgrade at call %d: call %d: %+v, want %+v", upgrade, i, got, want)
				}
				if state, err := rdb.Get(ctx, key).Result(); err != nil || !strings.HasPrefix(state, "c") {
					t.Fatalf("upgrade at call %d: call %d left %q, %v; want the cumulative form", upgrade, i, state, err)
				}
				if i == upgrade {
					upgraded++
				}
			}
		}
		if upgraded < calls-1 || denied < calls || ahead < calls {
			t.Fatalf("%d upgrades, %d calls refused, %d booked ahead: the timelines test too little", upgraded, denied, ahead)
		}
	}
}

// A bucket's state is written as every earlier version reads it, "ref
// blocked count last [s e]" (s and e when count is 1), by the quick steps
// of AllowN, ReserveN and a two-bucket Book as by book.lua, on the FCALL and
// the EVALSHA paths: a fleet upgrades process by process, its versions
// reading each other's states.
func TestBucketStateForEveryVersion(t *testing.T) {
	ctx := context.Background()
	functions, scripts := redistest.Client(t), redistest.Client(t)
	algorithms.BookScript.ScriptsOnly(scripts)
	earlier := regexp.MustCompile(`^-?\d+ -?\d+ (1 -?\d+ -?\d+ -?\d+|[02-9]\d* -?\d+)$`) // as earlier versions match it
	for _, rdb := range []*redis.Client{functions, scripts} {
		for _, a := range []throttle.Algorithm{throttle.TokenBucket, throttle.LeakyBucket} {
			t.Run(string(a), func(t *testing.T) {
				clock := testkit.NewClock(t0)
				prefix := redistest.Prefix(t)
				quota := newOn(t, rdb, throttle.Spec{Algorithm: a, Limit: 5, Period: time.Second, Burst: 3}, clock, prefix+"quota:")
				drain := newOn(t, rdb, throttle.Spec{Algorithm: a, Limit: 3, Period: time.Second, Burst: 1}, clock, prefix+"drain:")
				states := map[string]bool{}
				for i := range 60 {
					clock.Set(t0.Add(time.Duration(i) * 130 * time.Millisecond))
					var err error
					switch i % 3 {
					case 0:
						_, err = quota.AllowN(ctx, "k", 1+i%2)
					case 1:
						_, err = quota.ReserveN(ctx, "k", 1, 300*time.Millisecond)
					default:
						_, err = throttle.Book(ctx, []throttle.Claim{{Limiter: drain, Key: "k", N: 1}, {Limiter: quota, Key: "k", N: 1}}, clock.Now(), 500*time.Millisecond)
					}
					if err != nil {
						t.Fatal(err)
					}
					keys, err := rdb.Keys(ctx, prefix+"*").Result()
					if err != nil {
						t.Fatal(err)
					}
					for _, k := range keys {
						if strings.HasSuffix(k, ":b") {
							continue // spans, a sorted set
						}
						state, err := rdb.Get(ctx, k).Result()
						if err != nil {
							t.Fatal(err)
						}
						if !earlier.MatchString(state) {
							t.Fatalf("call %d: key %q holds %q, which earlier versions do not read", i, k, state)
						}
						states[state] = true
					}
				}
				if len(states) < 40 {
					t.Fatalf("%d states seen: the timeline tests too little", len(states))
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
// its time, not 25,000.) Its Lua has no struct library either: a sliding
// counter keeps the text form there.
func TestMiniredis(t *testing.T) {
	ctx := context.Background()
	mini := miniredis.RunT(t)
	rdb := redis.NewClient(&redis.Options{Addr: mini.Addr()})
	t.Cleanup(func() { rdb.Close() })
	for _, a := range []throttle.Algorithm{throttle.TokenBucket, throttle.LeakyBucket, throttle.SlidingCounter} {
		t.Run(string(a), func(t *testing.T) {
			spec := throttle.Spec{Algorithm: a, Limit: 4, Period: 100 * time.Millisecond, Burst: 3, Windows: 5}
			clock := testkit.NewClock(t0)
			prefix := redistest.Prefix(t)
			lim := newOn(t, rdb, spec, clock, prefix)
			local, err := throttle.NewLocal(spec, throttle.WithClock(clock))
			if err != nil {
				t.Fatal(err)
			}
			var waited, refused int
			for i := range 40 {
				clock.Set(t0.Add(time.Duration(i) * 10 * time.Millisecond))
				maxWait := time.Duration(i%2) * 50 * time.Millisecond
				got, err := lim.ReserveN(ctx, "k", 1, maxWait)
				if err != nil {
					t.Fatal(err)
				}
				want, err := local.ReserveN(ctx, "k", 1, maxWait)
				if err != nil {
					t.Fatal(err)
				}
				if got != want {
					t.Fatalf("call %d: %+v, want %+v", i, got, want)
				}
				if state, err := mini.Get(throttle.Key(prefix, "k")); a == throttle.SlidingCounter && (err != nil || !strings.HasPrefix(state, "0")) {
					t.Fatalf("call %d: state %q, %v; want the text form", i, state, err)
				}
				if !got.OK {
					refused++
				} else if got.Delay > 0 {
					waited++
				}
			}
			if waited == 0 || refused == 0 {
				t.Fatalf("%d calls waited, %d refused: the timeline tests too little", waited, refused)
			}
		})
	}
}
