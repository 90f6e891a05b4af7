package throttle_test

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/internal/redistest"
	"github.com/sluicehq/sluice/internal/testkit"
	"github.com/sluicehq/sluice/throttle"
)

// loadsByKey indexes Loads' answer by key value:
// loadsByKey(t)(throttle.Loads(ctx, lim)).
func loadsByKey(t *testing.T) func([]throttle.KeyLoad, error) map[string]throttle.KeyLoad {
	return func(loads []throttle.KeyLoad, err error) map[string]throttle.KeyLoad {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
		byKey := map[string]throttle.KeyLoad{}
		for _, l := range loads {
			if _, dup := byKey[l.Key]; dup {
				t.Fatalf("key %q listed twice", l.Key)
			}
			byKey[l.Key] = l
		}
		return byKey
	}
}

func TestLoads(t *testing.T) {
	ctx := context.Background()
	long := strings.Repeat("x", 200) // kept under its hash
	for _, e := range engines(t)[1:] {
		t.Run(e.name, func(t *testing.T) {
			clock := testkit.NewClock(t0)
			spec := throttle.Spec{Algorithm: throttle.TokenBucket, Limit: 4, Period: time.Second, Burst: 4}
			r, err := throttle.New(e.rdb, spec, throttle.WithClock(clock), throttle.WithPrefix(redistest.Prefix(t)), throttle.WithRecentThrottles())
			if err != nil {
				t.Fatal(err)
			}
			// "busy{1}": 4 at once, 6 booked ahead (throttled), 1 refused
			// (throttled); "quiet %": 1; long: 1.
			for i := range 10 {
				res, err := r.ReserveN(ctx, "busy{1}", 1, 10*time.Second)
				if err != nil || !res.OK || (res.Delay > 0) != (i >= 4) {
					t.Fatalf("reservation %d: %+v, %v", i, res, err)
				}
			}
			if d, err := r.AllowN(ctx, "busy{1}", 1); err != nil || d.Allowed {
				t.Fatalf("AllowN on a full key: %+v, %v", d, err)
			}
			for _, key := range []string{"quiet %", long} {
				if d, err := r.AllowN(ctx, key, 1); err != nil || !d.Allowed {
					t.Fatalf("AllowN(%q): %+v, %v", key, d, err)
				}
			}
			got := loadsByKey(t)(throttle.Loads(ctx, r))
			want := map[string]throttle.KeyLoad{
				"busy{1}": {Key: "busy{1}", Waiting: 6, Throttled: 7},
				"quiet %": {Key: "quiet %", CanAdmit: true, Remaining: 3},
			}
			if len(got) != 3 {
				t.Fatalf("Loads listed %v, want busy{1}, quiet %% and the long key", slices.Sorted(maps.Keys(got)))
			}
			for key, w := range want {
				if got[key] != w {
					t.Errorf("Loads[%q] = %+v, want %+v", key, got[key], w)
				}
			}
			for key, l := range got {
				if _, ok := want[key]; !ok && (!strings.HasPrefix(key, "#") || len(key) != 33 || l.Remaining != 3) {
					t.Errorf("Loads listed %+v, want the long key by its hash, with 3 left", l)
				}
			}
			// 1s on: 4 of the 6 turns ahead have come (a turn a second
			// apart each 250ms).
			clock.Add(time.Second)
			if got := loadsByKey(t)(throttle.Loads(ctx, r))["busy{1}"]; got.Waiting != 2 || got.Throttled != 7 || got.CanAdmit {
				t.Errorf("1s on, Loads[busy{1}] = %+v, want 2 waiting, 7 throttled", got)
			}
			// A minute and more on: nothing throttled lately, all turns passed.
			clock.Add(80 * time.Second)
			if got := loadsByKey(t)(throttle.Loads(ctx, r))["busy{1}"]; got != (throttle.KeyLoad{Key: "busy{1}", CanAdmit: true, Remaining: 4}) && got.Key != "" {
				t.Errorf("81s on, Loads[busy{1}] = %+v, want idle", got)
			}
		})
	}
}

// TestLoadsCounting: without WithRecentThrottles nothing is counted; a
// look writes nothing. The clock is pinned: on Redis's own clock the three
// calls could straddle a window's end and find the limit full again.
func TestLoadsCounting(t *testing.T) {
	ctx := context.Background()
	rdb := redistest.Client(t)
	prefix := redistest.Prefix(t)
	clock := testkit.NewClock(t0)
	lim, err := throttle.New(rdb, throttle.Spec{Algorithm: throttle.FixedWindow, Limit: 1, Period: time.Second}, throttle.WithPrefix(prefix), throttle.WithClock(clock))
	if err != nil {
		t.Fatal(err)
	}
	for range 3 {
		if _, err := lim.AllowN(ctx, "k", 1); err != nil {
			t.Fatal(err)
		}
	}
	before, _ := rdb.Keys(ctx, prefix+"*").Result()
	got := loadsByKey(t)(throttle.Loads(ctx, lim))
	if got["k"] != (throttle.KeyLoad{Key: "k", Waiting: -1}) || len(got) != 1 {
		t.Fatalf("Loads = %+v, want k alone, nothing counted, waiting unknown, full", got)
	}
	after, _ := rdb.Keys(ctx, prefix+"*").Result()
	if slices.Compare(slices.Sorted(slices.Values(before)), slices.Sorted(slices.Values(after))) != 0 {
		t.Fatalf("keys before Loads %v, after %v", before, after)
	}
}

// TestLoadsOfSeveral (19.11): Loads of several limiters, under prefixes
// that share a beginning or none (one under a UTF-8 prefix cut in its
// common part), lists the keys of each and of no other limiter, each with
// its own spec's room; limiters on two Redis clients are refused.
func TestLoadsOfSeveral(t *testing.T) {
	ctx := context.Background()
	rdb := redistest.Client(t)
	prefix := redistest.Prefix(t)
	newLim := func(rdb redis.UniversalClient, prefix string, limit int) throttle.Limiter {
		t.Helper()
		lim, err := throttle.New(rdb, throttle.Spec{Algorithm: throttle.FixedWindow, Limit: limit, Period: time.Minute}, throttle.WithPrefix(prefix))
		if err != nil {
			t.Fatal(err)
		}
		return lim
	}
	base, over, other, apart := newLim(rdb, prefix+"k:é:", 5), newLim(rdb, prefix+"k:è:", 9), newLim(rdb, prefix+"k:é", 5), newLim(rdb, "x"+prefix, 5)
	for lim, key := range map[throttle.Limiter]string{base: "a", over: "b", other: "c", apart: "d"} {
		if _, err := lim.AllowN(ctx, key, 1); err != nil {
			t.Fatal(err)
		}
	}
	got := loadsByKey(t)(throttle.Loads(ctx, base, over, apart))
	want := map[string]throttle.KeyLoad{
		"a": {Key: "a", Waiting: -1, CanAdmit: true, Remaining: 4},
		"b": {Key: "b", Waiting: -1, CanAdmit: true, Remaining: 8},
		"d": {Key: "d", Waiting: -1, CanAdmit: true, Remaining: 4},
	}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("Loads = %+v\nwant %+v", got, want)
	}
	if _, err := throttle.Loads(ctx, base, newLim(redistest.Cluster(t), prefix, 5)); err == nil || !strings.Contains(err.Error(), "different Redis clients") {
		t.Fatalf("Loads of limiters on two clients: %v, want refused", err)
	}
}

func TestSemaphoreLoads(t *testing.T) {
	ctx := context.Background()
	for _, e := range engines(t)[1:] {
		t.Run(e.name, func(t *testing.T) {
			clock := testkit.NewClock(t0)
			sem, err := throttle.NewSemaphore(e.rdb, 2, 10*time.Second, throttle.WithClock(clock), throttle.WithPrefix(redistest.Prefix(t)), throttle.WithRecentThrottles())
			if err != nil {
				t.Fatal(err)
			}
			for _, h := range []string{"a", "b", "c", "d"} {
				if _, err := sem.Acquire(ctx, "full", h); err != nil {
					t.Fatal(err)
				}
			}
			if _, err := sem.Acquire(ctx, "half", "a"); err != nil {
				t.Fatal(err)
			}
			got := loadsByKey(t)(sem.Loads(ctx))
			want := map[string]throttle.KeyLoad{
				"full": {Key: "full", Waiting: -1, Throttled: 2},
				"half": {Key: "half", Waiting: -1, CanAdmit: true, Remaining: 1},
			}
			if !maps.Equal(got, want) {
				t.Fatalf("Loads = %+v, want %+v", got, want)
			}
			// The leases end: nobody holds a slot, and the refusals are over a minute old.
			clock.Add(75 * time.Second)
			got = loadsByKey(t)(sem.Loads(ctx))
			for key, l := range got {
				if l.Throttled != 0 || l.Remaining != 2 {
					t.Errorf("75s on, Loads[%q] = %+v, want idle", key, l)
				}
			}
		})
	}
}

// TestLoadsAfterStateExpired: a key whose state has expired but whose
// throttles are still recent is listed as idle and throttled, and the
// look does not bring its state back.
func TestLoadsAfterStateExpired(t *testing.T) {
	ctx := context.Background()
	rdb := redistest.Client(t)
	prefix := redistest.Prefix(t)
	lim, err := throttle.New(rdb, throttle.Spec{Algorithm: throttle.TokenBucket, Limit: 1, Period: time.Second, Burst: 1},
		throttle.WithPrefix(prefix), throttle.WithRecentThrottles(), throttle.WithClock(testkit.NewClock(t0)))
	if err != nil {
		t.Fatal(err)
	}
	for range 3 {
		if _, err := lim.AllowN(ctx, "k", 1); err != nil {
			t.Fatal(err)
		}
	}
	keys, _ := rdb.Keys(ctx, prefix+"*").Result()
	var state []string
	for _, k := range keys {
		if !strings.HasSuffix(k, ":x") {
			state = append(state, k)
		}
	}
	if len(state) == 0 || len(state) == len(keys) {
		t.Fatalf("keys %v: want the state and one count of recent throttles", keys)
	}
	rdb.Del(ctx, state...) // as if expired
	got := loadsByKey(t)(throttle.Loads(ctx, lim))
	if want := (throttle.KeyLoad{Key: "k", Throttled: 2, CanAdmit: true, Remaining: 1}); got["k"] != want || len(got) != 1 {
		t.Fatalf("Loads = %+v, want only %+v", got, want)
	}
	if after, _ := rdb.Keys(ctx, prefix+"*").Result(); len(after) != 1 {
		t.Fatalf("keys after Loads %v, want only the count of recent throttles", after)
	}
}

// TestNoteThrottledAndRefusalsOnly (issue 20, commands per task): events
// throttled without a Book (NoteThrottled) count in a key's recent
// throttles as a refused Book's do; a Book with RecentRefusalsOnly counts
// a later turn than it asked for as nothing and a refusal as usual, where
// a Book without it counts both. On a standalone server and the cluster.
func TestNoteThrottledAndRefusalsOnly(t *testing.T) {
	ctx := context.Background()
	for name, rdb := range map[string]redis.UniversalClient{"redis": redistest.Client(t), "cluster": redistest.Cluster(t)} {
		t.Run(name, func(t *testing.T) {
			clock := testkit.NewClock(t0)
			lim, err := throttle.New(rdb, throttle.Spec{Algorithm: throttle.TokenBucket, Limit: 10, Period: time.Second, Burst: 1},
				throttle.WithPrefix(redistest.Prefix(t)), throttle.WithClock(clock), throttle.WithRecentThrottles())
			if err != nil {
				t.Fatal(err)
			}
			throttled := func() int {
				t.Helper()
				return loadsByKey(t)(throttle.Loads(ctx, lim))["k"].Throttled
			}
			if err := throttle.NoteThrottled(ctx, lim, "k", 7); err != nil {
				t.Fatal(err)
			}
			if got := throttled(); got != 7 {
				t.Fatalf("after NoteThrottled of 7: %d throttled, want 7", got)
			}
			claim := []throttle.Claim{{Limiter: lim, Key: "k", N: 1}}
			book := func(maxWait time.Duration, opts ...throttle.BookOption) throttle.Booking {
				t.Helper()
				b, err := throttle.Book(ctx, claim, time.Time{}, maxWait, opts...)
				if err != nil {
					t.Fatal(err)
				}
				return b
			}
			book(time.Second)                                                                      // now: nothing throttled
			if b := book(time.Second, throttle.RecentRefusalsOnly()); !b.OK || b.Delay != 100*ms { // a later turn
				t.Fatalf("second booking %+v, want +100ms", b)
			}
			if got := throttled(); got != 7 {
				t.Fatalf("after a later turn booked with RecentRefusalsOnly: %d throttled, want still 7", got)
			}
			if b := book(0, throttle.RecentRefusalsOnly()); b.OK { // refused: counted
				t.Fatalf("a booking of now on a full bucket: %+v, want refused", b)
			}
			if got := throttled(); got != 8 {
				t.Fatalf("after a refusal with RecentRefusalsOnly: %d throttled, want 8", got)
			}
			book(time.Second) // a later turn, without the option: counted
			if got := throttled(); got != 9 {
				t.Fatalf("after a later turn booked: %d throttled, want 9", got)
			}
			plain, err := throttle.New(rdb, throttle.Spec{Algorithm: throttle.TokenBucket, Limit: 10, Period: time.Second, Burst: 1}, throttle.WithPrefix(redistest.Prefix(t)))
			if err != nil {
				t.Fatal(err)
			}
			if err := throttle.NoteThrottled(ctx, plain, "k", 3); err != nil {
				t.Fatalf("NoteThrottled on a limiter that counts none: %v, want nothing done", err)
			}
		})
	}
}
