package throttle_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/internal/testkit"
	"github.com/sluicehq/sluice/throttle"
)

// drain and quota are the shape sluice exists for: a queue drained at 25/s
// one by one, whose tasks draw on an API's quota of 10/s with burst 5.
var (
	drainSpec = throttle.Spec{Algorithm: throttle.LeakyBucket, Limit: 25, Period: time.Second, Burst: 1}
	quotaSpec = throttle.Spec{Algorithm: throttle.TokenBucket, Limit: 10, Period: time.Second, Burst: 5}
)

func book(t *testing.T, claims []throttle.Claim, notBefore time.Time, maxWait time.Duration) throttle.Booking {
	t.Helper()
	b, err := throttle.Book(context.Background(), claims, notBefore, maxWait)
	if err != nil {
		t.Fatalf("Book: %v", err)
	}
	return b
}

// TestTurnsInAnyOrder: a turn booked far ahead does not hold back the
// instants before it. Each algorithm, once a turn is booked 2s ahead, still
// admits now, and books a turn before the far one in the gap it left.
func TestTurnsInAnyOrder(t *testing.T) {
	forEach(t, func(t *testing.T, e engine, a throttle.Algorithm) {
		lim, _ := fivePerSecondOn(t, e, a)
		r := lim
		ctx := context.Background()
		far, err := r.ReserveAfter(ctx, "k", 1, t0.Add(2*time.Second), 3*time.Second)
		if err != nil || !far.OK || !far.At.Equal(t0.Add(2*time.Second)) {
			t.Fatalf("turn 2s ahead = %+v, %v; want it at +2s", far, err)
		}
		if d := allow(t, lim, "k", 1); !d.Allowed {
			t.Fatalf("AllowN now, with a turn booked at +2s = %+v; want allowed", d)
		}
		between, err := r.ReserveAfter(ctx, "k", 1, t0.Add(time.Second), 3*time.Second)
		if err != nil || !between.OK || !between.At.Equal(t0.Add(time.Second)) {
			t.Fatalf("turn at +1s, between a call now and a turn at +2s = %+v, %v; want it at +1s", between, err)
		}
	})
}

// TestLeakyBucketFillsGaps: with burst 1 at 5/s, turns are 200ms apart
// whatever order they are booked in: a turn asked for just before one
// booked earlier goes after it, one asked for in a gap takes it.
func TestLeakyBucketFillsGaps(t *testing.T) {
	for _, e := range engines(t) {
		t.Run(e.name, func(t *testing.T) {
			r, _ := mustLimiter(t, e, throttle.Spec{Algorithm: throttle.LeakyBucket, Limit: 5, Period: time.Second, Burst: 1})
			ctx := context.Background()
			for _, c := range []struct {
				notBefore, want time.Duration
			}{
				{2000 * ms, 2000 * ms},
				{1900 * ms, 2200 * ms}, // would end inside the turn at 2s
				{1500 * ms, 1500 * ms}, // a gap
				{1700 * ms, 1700 * ms}, // exactly between 1.5s and 2s
				{0, 0},
				{100 * ms, 200 * ms},
				{1600 * ms, 2400 * ms},
			} {
				res, err := r.ReserveAfter(ctx, "k", 1, t0.Add(c.notBefore), 5*time.Second)
				if err != nil || !res.OK || !res.At.Equal(t0.Add(c.want)) {
					t.Fatalf("turn not before +%v = %+v, %v; want at +%v", c.notBefore, res, err, c.want)
				}
			}
		})
	}
}

// TestCancelAnyTurn: a turn given back is free again exactly, whichever
// turn it was, on every algorithm: the next call asking for that instant
// gets it, and the turns booked after it keep theirs.
func TestCancelAnyTurn(t *testing.T) {
	forEach(t, func(t *testing.T, e engine, a throttle.Algorithm) {
		spec := throttle.Spec{Algorithm: a, Limit: 1, Period: 200 * ms, Burst: 1, Windows: 1}
		r, _ := mustLimiter(t, e, spec)
		ctx := context.Background()
		var turns []throttle.Reservation
		for range 4 {
			res, err := r.ReserveN(ctx, "k", 1, time.Second)
			if err != nil || !res.OK {
				t.Fatalf("ReserveN = %+v, %v", res, err)
			}
			turns = append(turns, res)
		}
		middle := turns[1]
		if err := r.Cancel(ctx, "k", middle); err != nil {
			t.Fatal(err)
		}
		again, err := r.ReserveN(ctx, "k", 1, time.Second)
		if err != nil || !again.OK || !again.At.Equal(middle.At) {
			t.Fatalf("turn after cancelling the one at %v = %+v, %v; want that turn", middle.At.Sub(t0), again, err)
		}
		next, err := r.ReserveN(ctx, "k", 1, 2*time.Second)
		if err != nil || !next.OK || !next.At.Equal(turns[3].At.Add(200*ms)) {
			t.Fatalf("turn after the four = %+v, %v; want at %v, after the last", next, err, turns[3].At.Add(200*ms).Sub(t0))
		}
	})
}

// TestBookDrainAndQuota: a drain of 25/s and a quota of 10/s burst 5
// booked together give every task the earliest instant at which both admit
// it: 40ms apart while the quota's burst lasts, then 100ms apart, the
// quota's rate, with no turn of either lost. On the cluster the drain and
// the quota are in different slots; the turns are the same.
func TestBookDrainAndQuota(t *testing.T) {
	// The quota's 5 tokens at 0 and one more each 100ms last until 240ms at
	// the drain's pace; from then on each turn waits for a token.
	want := []time.Duration{0, 40 * ms, 80 * ms, 120 * ms, 160 * ms, 200 * ms, 240 * ms, 300 * ms, 400 * ms, 500 * ms, 600 * ms, 700 * ms}
	for _, e := range engines(t) {
		t.Run(e.name, func(t *testing.T) {
			clock := testkit.NewClock(t0)
			drain := mustNew(t, e, drainSpec, clock, "drain")
			quota := mustNew(t, e, quotaSpec, clock, "quota")
			claims := []throttle.Claim{{Limiter: drain, Key: "emails", N: 1}, {Limiter: quota, Key: "api", N: 1}}
			var got []time.Duration
			for range want {
				b := book(t, claims, time.Time{}, 5*time.Second)
				if !b.OK || len(b.Turns) != 2 || !b.Turns[0].At.Equal(b.At) || !b.Turns[1].At.Equal(b.At) {
					t.Fatalf("Book = %+v; want OK with both turns at At", b)
				}
				got = append(got, b.At.Sub(t0))
			}
			if fmt.Sprint(got) != fmt.Sprint(want) {
				t.Fatalf("turns %v, want %v", got, want)
			}
		})
	}
}

func mustNew(t *testing.T, e engine, spec throttle.Spec, clock *testkit.Clock, name string) throttle.Reserver {
	t.Helper()
	lim, err := e.new(spec, throttle.WithClock(clock), throttle.WithPrefix(fmt.Sprintf("%s:%s:", t.Name(), name)))
	if err != nil {
		t.Fatal(err)
	}
	return lim
}

// TestBookAllOrNothing: when one claim cannot be given a turn within
// maxWait, nothing is counted on the others either.
func TestBookAllOrNothing(t *testing.T) {
	for _, e := range engines(t) {
		t.Run(e.name, func(t *testing.T) {
			clock := testkit.NewClock(t0)
			drain := mustNew(t, e, drainSpec, clock, "drain")
			quota := mustNew(t, e, quotaSpec, clock, "quota")
			ctx := context.Background()
			if err := quota.Block(ctx, "api", 3*time.Second); err != nil {
				t.Fatal(err)
			}
			b := book(t, []throttle.Claim{{Limiter: drain, Key: "emails", N: 1}, {Limiter: quota, Key: "api", N: 1}}, time.Time{}, time.Second)
			if b.OK || b.Turns[1].Delay != 3*time.Second || b.Turns[0].Delay != 0 || b.Delay < 3*time.Second {
				t.Fatalf("Book with the quota blocked for 3s and maxWait 1s = %+v; want not OK, the quota's own wait 3s, the drain's 0", b)
			}
			if level, err := drain.Peek(ctx, "emails"); err != nil || level.Remaining != 1 {
				t.Fatalf("drain after the refused Book: %+v, %v; want its one event still free", level, err)
			}
		})
	}
}

// TestBookMisuse: arguments Book cannot act on are ErrMisuse, not a
// denial, and not a cost error; nothing is counted.
func TestBookMisuse(t *testing.T) {
	for _, e := range engines(t) {
		t.Run(e.name, func(t *testing.T) {
			clock := testkit.NewClock(t0)
			drain := mustNew(t, e, drainSpec, clock, "drain")
			ctx := context.Background()
			twice := []throttle.Claim{{Limiter: drain, Key: "emails", N: 1}, {Limiter: drain, Key: "emails", N: 1}}
			if _, err := throttle.Book(ctx, twice, time.Time{}, time.Second); !errors.Is(err, throttle.ErrMisuse) || errors.Is(err, throttle.ErrInvalidCost) {
				t.Errorf("Book with two claims on one key: %v, want ErrMisuse only", err)
			}
			once := twice[:1]
			if _, err := throttle.Book(ctx, once, time.Time{}, -time.Second); !errors.Is(err, throttle.ErrMisuse) {
				t.Errorf("Book with a negative maxWait: %v, want ErrMisuse", err)
			}
			if level, err := drain.Peek(ctx, "emails"); err != nil || level.Remaining != 1 {
				t.Fatalf("drain after the refused Books: %+v, %v; want its one event still free", level, err)
			}
		})
	}
}

// TestBookTurnMoves: a claim that replaces an earlier turn gives it back in
// the same step, so the turn it leaves is free for the next caller.
func TestBookTurnMoves(t *testing.T) {
	for _, e := range engines(t) {
		t.Run(e.name, func(t *testing.T) {
			clock := testkit.NewClock(t0)
			drain := mustNew(t, e, drainSpec, clock, "drain")
			quota := mustNew(t, e, quotaSpec, clock, "quota")
			first := book(t, []throttle.Claim{{Limiter: drain, Key: "q", N: 1}, {Limiter: quota, Key: "api", N: 1}}, time.Time{}, time.Second)
			moved := book(t, []throttle.Claim{
				{Limiter: drain, Key: "q", N: 1, Replaces: &first.Turns[0]},
				{Limiter: quota, Key: "api", N: 1, Replaces: &first.Turns[1]},
			}, t0.Add(500*ms), time.Second)
			if !moved.OK || !moved.At.Equal(t0.Add(500*ms)) {
				t.Fatalf("moved turn = %+v; want at +500ms", moved)
			}
			next := book(t, []throttle.Claim{{Limiter: drain, Key: "q", N: 1}, {Limiter: quota, Key: "api", N: 1}}, time.Time{}, time.Second)
			if !next.OK || !next.At.Equal(t0) {
				t.Fatalf("Book after a turn moved away from now = %+v; want the turn it left, now", next)
			}
		})
	}
}

// TestBookSharedQuotaOutOfOrder: three drains of 5, 10 and 20 per second
// share a quota of 40/s. Their turns are booked in a random order, each
// drain's far ahead, as workers pick tasks: every drain still gets its own
// rate from now on, and no limit is exceeded.
func TestBookSharedQuotaOutOfOrder(t *testing.T) {
	rates := []int{5, 10, 20}
	for _, e := range engines(t) {
		t.Run(e.name, func(t *testing.T) {
			clock := testkit.NewClock(t0)
			quota := mustNew(t, e, throttle.Spec{Algorithm: throttle.TokenBucket, Limit: 40, Period: time.Second, Burst: 10}, clock, "quota")
			var drains []throttle.Limiter
			var order []int
			for i, r := range rates {
				drains = append(drains, mustNew(t, e, throttle.Spec{Algorithm: throttle.LeakyBucket, Limit: r, Period: time.Second, Burst: 1}, clock, fmt.Sprint("drain", i)))
				for range 2 * r { // two seconds of work
					order = append(order, i)
				}
			}
			rand.New(rand.NewPCG(1, 2)).Shuffle(len(order), func(i, j int) { order[i], order[j] = order[j], order[i] })
			turns := make([][]event, len(rates))
			var all []event
			for _, i := range order {
				b := book(t, []throttle.Claim{{Limiter: drains[i], Key: "q", N: 1}, {Limiter: quota, Key: "api", N: 1}}, time.Time{}, 10*time.Second)
				if !b.OK {
					t.Fatalf("Book for drain %d = %+v; want OK", i, b)
				}
				turns[i] = append(turns[i], event{b.At.UnixMicro(), 1})
				all = append(all, event{b.At.UnixMicro(), 1})
			}
			for i, r := range rates {
				last := turns[i][0].at
				for _, ev := range turns[i] {
					last = max(last, ev.at)
				}
				// 2r turns at r per second from now: the last at (2r-1)/r s.
				if want := t0.Add(time.Duration(2*r-1) * time.Second / time.Duration(r)).UnixMicro(); last != want {
					t.Errorf("drain of %d/s: last of %d turns at +%v, want +%v (its own rate)", r, 2*r, time.Duration(last-t0.UnixMicro())*time.Microsecond, time.Duration(want-t0.UnixMicro())*time.Microsecond)
				}
				if err := conforms(throttle.Spec{Algorithm: throttle.LeakyBucket, Limit: r, Period: time.Second, Burst: 1}, turns[i]); err != nil {
					t.Errorf("drain of %d/s: %v", r, err)
				}
			}
			if err := conforms(throttle.Spec{Algorithm: throttle.TokenBucket, Limit: 40, Period: time.Second, Burst: 10}, all); err != nil {
				t.Errorf("quota: %v", err)
			}
		})
	}
}

// deadLimiters returns a maker of drainSpec limiters on clock, with the
// failure policy it is given (the local one's share: all of it), on a Redis
// that refuses every connection.
func deadLimiters(t *testing.T, clock throttle.Clock) func(policy string) throttle.Reserver {
	dead := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", MaxRetries: -1, DialTimeout: 50 * time.Millisecond, DialerRetries: 1})
	t.Cleanup(func() { dead.Close() })
	return func(policy string) throttle.Reserver {
		lim, err := throttle.New(dead, drainSpec, throttle.WithClock(clock), throttle.WithOnRedisError(policy, func() int { return 1 }))
		if err != nil {
			t.Fatal(err)
		}
		return lim
	}
}

// TestBookPolicies: claims whose Redis fails are decided by their
// limiter's policy: deny fails the Book, allow lets it through uncounted,
// local books on an in-process twin.
func TestBookPolicies(t *testing.T) {
	ctx := context.Background()
	clock := testkit.NewClock(t0)
	newDead := deadLimiters(t, clock)
	live, err := throttle.NewLocal(quotaSpec, throttle.WithClock(clock))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := throttle.Book(ctx, []throttle.Claim{{Limiter: newDead(throttle.OnRedisErrorDeny), Key: "q", N: 1}, {Limiter: live, Key: "api", N: 1}}, time.Time{}, time.Second); !errors.Is(err, throttle.ErrRedisDenied) {
		t.Fatalf("Book with a deny claim on a dead Redis: %v, want ErrRedisDenied", err)
	}
	if level, _ := live.Peek(ctx, "api"); level.Remaining != 5 {
		t.Fatalf("the live quota after a denied Book has %d left, want all 5: nothing counted", level.Remaining)
	}
	b := book(t, []throttle.Claim{{Limiter: newDead(throttle.OnRedisErrorAllow), Key: "q", N: 1}, {Limiter: live, Key: "api", N: 1}}, time.Time{}, time.Second)
	if !b.OK || b.Turns[0].Fallback != throttle.OnRedisErrorAllow || b.Turns[1].Fallback != "" {
		t.Fatalf("Book with an allow claim on a dead Redis = %+v; want OK, the dead claim allowed", b)
	}
	local := newDead(throttle.OnRedisErrorLocal)
	var ats []time.Duration
	for range 3 {
		b := book(t, []throttle.Claim{{Limiter: local, Key: "q", N: 1}}, time.Time{}, time.Second)
		if !b.OK || b.Turns[0].Fallback != throttle.OnRedisErrorLocal {
			t.Fatalf("Book with a local claim on a dead Redis = %+v; want OK on the twin", b)
		}
		ats = append(ats, b.At.Sub(t0))
	}
	if fmt.Sprint(ats) != "[0s 40ms 80ms]" {
		t.Fatalf("turns on the local twin of 25/s: %v, want [0s 40ms 80ms]", ats)
	}
}

// TestOneClaimPolicies: AllowN and ReserveN on a dead Redis (which skip
// Book's machinery when Redis answers) are decided by the failure policy
// as a Book of their one claim is: deny fails, allow lets the events
// through uncounted, local decides on the twin, turn for turn.
func TestOneClaimPolicies(t *testing.T) {
	ctx := context.Background()
	clock := testkit.NewClock(t0)
	newDead := deadLimiters(t, clock)
	for _, policy := range []string{throttle.OnRedisErrorDeny, throttle.OnRedisErrorAllow, throttle.OnRedisErrorLocal} {
		t.Run(policy, func(t *testing.T) {
			alone, booked := newDead(policy), newDead(policy)
			for i := range 4 {
				clock.Set(t0.Add(time.Duration(i) * 10 * time.Millisecond))
				maxWait := time.Duration(i%2) * 50 * time.Millisecond
				got, gotErr := alone.ReserveN(ctx, "q", 1, maxWait)
				b, wantErr := throttle.Book(ctx, []throttle.Claim{{Limiter: booked, Key: "q", N: 1}}, time.Time{}, maxWait)
				if policy == throttle.OnRedisErrorDeny {
					if !errors.Is(gotErr, throttle.ErrRedisDenied) || !errors.Is(wantErr, throttle.ErrRedisDenied) {
						t.Fatalf("call %d: ReserveN: %v, Book: %v; want ErrRedisDenied", i, gotErr, wantErr)
					}
					if _, err := alone.AllowN(ctx, "q", 1); !errors.Is(err, throttle.ErrRedisDenied) {
						t.Fatalf("call %d: AllowN: %v; want ErrRedisDenied", i, err)
					}
					continue
				}
				if gotErr != nil || wantErr != nil {
					t.Fatalf("call %d: ReserveN: %v, Book: %v", i, gotErr, wantErr)
				}
				want := b.Turns[0]
				if !want.OK {
					want.Delay = max(want.Delay, b.Delay)
				}
				if got != want || got.Fallback != policy {
					t.Fatalf("call %d: ReserveN = %+v, Book's turn %+v; want them equal, by %s", i, got, want, policy)
				}
			}
			if policy == throttle.OnRedisErrorAllow {
				if d, err := alone.AllowN(ctx, "q", 1); err != nil || !d.Allowed {
					t.Fatalf("AllowN = %+v, %v; want allowed", d, err)
				}
			}
		})
	}
}

// TestLocalSharesUnknown (issue 19.13): a local policy whose shares are
// not known yet (shares returns 0) denies, as deny does; once they are
// known, the twin admits its share (Divide: 25/s among 2 is 12/s).
func TestLocalSharesUnknown(t *testing.T) {
	dead := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", MaxRetries: -1, DialTimeout: 50 * time.Millisecond})
	t.Cleanup(func() { dead.Close() })
	clock := testkit.NewClock(t0)
	var shares atomic.Int64
	local, err := throttle.New(dead, drainSpec, throttle.WithClock(clock), throttle.WithOnRedisError(throttle.OnRedisErrorLocal, func() int { return int(shares.Load()) }))
	if err != nil {
		t.Fatal(err)
	}
	claims := []throttle.Claim{{Limiter: local, Key: "q", N: 1}}
	if _, err := throttle.Book(context.Background(), claims, time.Time{}, time.Second); !errors.Is(err, throttle.ErrRedisDenied) {
		t.Fatalf("Book on a local twin whose shares are not known: %v, want ErrRedisDenied", err)
	}
	shares.Store(2)
	var ats []time.Duration
	for range 2 {
		b := book(t, claims, time.Time{}, time.Second)
		if !b.OK || b.Turns[0].Fallback != throttle.OnRedisErrorLocal {
			t.Fatalf("Book on a local twin of 2 shares = %+v; want OK on the twin", b)
		}
		ats = append(ats, b.At.Sub(t0))
	}
	if want := 83334 * time.Microsecond; ats[1] != want { // 1s / 12, rounded up to whole µs
		t.Fatalf("turns on the local twin of 25/s among 2: %v, want the second at %v (12/s)", ats, want)
	}
}

// TestReservationText: a reservation kept as text (in a task's headers)
// comes back whole, can be given back by another process, and text that
// was tampered with is refused.
func TestReservationText(t *testing.T) {
	for _, e := range engines(t) {
		t.Run(e.name, func(t *testing.T) {
			lim, _ := mustLimiter(t, e, throttle.Spec{Algorithm: throttle.LeakyBucket, Limit: 5, Period: time.Second, Burst: 1})
			r := lim
			ctx := context.Background()
			res, err := r.ReserveN(ctx, "k", 1, time.Second)
			if err != nil {
				t.Fatal(err)
			}
			text, err := res.MarshalText()
			if err != nil {
				t.Fatal(err)
			}
			var back throttle.Reservation
			if err := back.UnmarshalText(text); err != nil || !back.OK || !back.At.Equal(res.At) || back.N != 1 {
				t.Fatalf("round trip of %q = %+v, %v", text, back, err)
			}
			if err := r.Cancel(ctx, "k", back); err != nil {
				t.Fatal(err)
			}
			if d := allow(t, lim, "k", 1); !d.Allowed {
				t.Fatalf("AllowN after giving back the turn read from text = %+v; want allowed", d)
			}
			for _, bad := range []string{"", "x;1;;", "1;0;;", "1;1;maybe;", "1;1;;1 2 3e9", "1;1;;99999999999999999999"} {
				if err := new(throttle.Reservation).UnmarshalText([]byte(bad)); err == nil {
					t.Errorf("UnmarshalText(%q) accepted", bad)
				}
			}
		})
	}
}

// TestBookByID: a turn booked ahead under IDs is given back to the same IDs
// without counting again (a task back for its turn, a call repeated after
// its reply was lost), until it has passed by MaxLate; then the claims book
// anew and the old turn is given back. Cancel by ID gives a turn back once
// however often it is called.
func TestBookByID(t *testing.T) {
	for _, e := range engines(t) {
		t.Run(e.name, func(t *testing.T) {
			clock := testkit.NewClock(t0)
			drain := mustNew(t, e, drainSpec, clock, "drain")
			quota := mustNew(t, e, quotaSpec, clock, "quota")
			claims := func(id string) []throttle.Claim {
				return []throttle.Claim{{Limiter: drain, Key: "q", N: 1, ID: id}, {Limiter: quota, Key: "api", N: 1, ID: id}}
			}
			late := throttle.MaxLate(100 * ms)
			book(t, claims(""), time.Time{}, time.Second) // now
			first := book(t, claims("task-1"), time.Time{}, time.Second)
			if !first.OK || first.Kept || first.Delay != 40*ms {
				t.Fatalf("first booking of task-1 = %+v; want OK at +40ms, counted", first)
			}
			backAt := func(at time.Duration) {
				t.Helper()
				clock.Set(t0.Add(at))
				again, err := throttle.Book(context.Background(), claims("task-1"), time.Time{}, time.Second, late)
				if err != nil || !again.OK || !again.Kept || !again.At.Equal(first.At) {
					t.Fatalf("task-1 back at +%v = %+v, %v; want its kept turn at +40ms, nothing counted", at, again, err)
				}
			}
			backAt(0)
			if next := book(t, claims("task-2"), time.Time{}, time.Second); !next.At.Equal(t0.Add(80 * ms)) {
				t.Fatalf("task-2 = %+v; want +80ms: task-1's return counted nothing", next)
			}
			backAt(40 * ms)
			backAt(140 * ms)
			// Back more than MaxLate after its turn: booked anew, and the old
			// turn given back.
			clock.Set(t0.Add(141 * ms))
			anew, err := throttle.Book(context.Background(), claims("task-1"), time.Time{}, time.Second, late)
			if err != nil || !anew.OK || anew.Kept || !anew.At.Equal(t0.Add(141*ms)) {
				t.Fatalf("task-1 back 101ms late = %+v, %v; want a new turn now", anew, err)
			}
			// Cancel by ID, twice: the turn is given back once.
			clock.Set(t0.Add(150 * ms))
			later := book(t, claims("task-3"), time.Time{}, time.Second) // at 181ms
			for range 2 {
				for i, lim := range []throttle.Limiter{drain, quota} {
					if err := lim.(throttle.Reserver).Cancel(context.Background(), claims("")[i].Key, later.Turns[i]); err != nil {
						t.Fatal(err)
					}
				}
			}
			next := book(t, claims(""), time.Time{}, time.Second)
			after := book(t, claims(""), time.Time{}, time.Second)
			if !next.At.Equal(later.At) || !after.At.Equal(later.At.Add(40*ms)) {
				t.Fatalf("after task-3's turn at %v was cancelled twice: turns at %v and %v; want it once, then 40ms later",
					later.At.Sub(t0), next.At.Sub(t0), after.At.Sub(t0))
			}
		})
	}
}

// TestBookLongID (19.4): a turn booked ahead under an ID of 2,000 bytes is
// kept like any other: the claim back with that ID gets it, counting
// nothing; a claim whose short ID is the long one's hash (what the key of
// its kept turn names) does not; Cancel of the turn read back from its
// text frees it. (Book refused IDs over 1 KiB as a bad cost.)
func TestBookLongID(t *testing.T) {
	long := strings.Repeat("x", 2000)
	hashed := strings.Trim(throttle.Key("", long), "{}") // "#" and 32 hex digits
	for _, e := range engines(t) {
		t.Run(e.name, func(t *testing.T) {
			clock := testkit.NewClock(t0)
			drain := mustNew(t, e, drainSpec, clock, "drain")
			claims := func(id string) []throttle.Claim { return []throttle.Claim{{Limiter: drain, Key: "q", N: 1, ID: id}} }
			book(t, claims(""), time.Time{}, time.Second) // now
			first := book(t, claims(long), time.Time{}, time.Second)
			if !first.OK || first.Kept || first.Delay != 40*ms {
				t.Fatalf("first booking under the long ID = %+v; want OK at +40ms, counted", first)
			}
			if again := book(t, claims(long), time.Time{}, time.Second); !again.Kept || !again.At.Equal(first.At) {
				t.Fatalf("back under the long ID = %+v; want its kept turn at +40ms", again)
			}
			if other := book(t, claims(hashed), time.Time{}, time.Second); other.Kept || !other.At.Equal(t0.Add(80*ms)) {
				t.Fatalf("a claim whose ID %q is the long one's hash = %+v; want a turn of its own at +80ms", hashed, other)
			}
			text, err := first.Turns[0].MarshalText()
			if err != nil {
				t.Fatal(err)
			}
			var turn throttle.Reservation
			if err := turn.UnmarshalText(text); err != nil {
				t.Fatal(err)
			}
			if err := drain.Cancel(context.Background(), "q", turn); err != nil {
				t.Fatal(err)
			}
			if next := book(t, claims(""), time.Time{}, time.Second); !next.At.Equal(first.At) {
				t.Fatalf("after the long ID's turn was given back, the next turn is at +%v; want its +40ms", next.At.Sub(t0))
			}
		})
	}
}

// TestKeptTurnAfterGap: a task back for its kept turn, when the bucket's
// busy time has a gap (a turn given back) and the time before the gap has
// passed, leaves the bucket as it was: the next turn is the same on every
// engine. (The script once trimmed the bucket's spans for the kept turn
// without saving the state that named them: the bucket forgot every turn
// booked, and admitted a burst over its limit.)
func TestKeptTurnAfterGap(t *testing.T) {
	spec := throttle.Spec{Algorithm: throttle.TokenBucket, Limit: 10, Period: time.Second, Burst: 5}
	for _, e := range engines(t) {
		t.Run(e.name, func(t *testing.T) {
			clock := testkit.NewClock(t0)
			quota := mustNew(t, e, spec, clock, "quota")
			claims := func(id string) []throttle.Claim { return []throttle.Claim{{Limiter: quota, Key: "api", N: 1, ID: id}} }
			// 5 at once, then one every 100ms to +1.5s, each kept under its ID.
			turns := map[string]throttle.Booking{}
			for i := range 20 {
				id := fmt.Sprint("task-", i)
				turns[id] = book(t, claims(id), time.Time{}, time.Minute)
			}
			// task-7's turn given back: a gap in the busy time.
			if err := quota.Cancel(context.Background(), "api", turns["task-7"].Turns[0]); err != nil {
				t.Fatal(err)
			}
			// Past the busy time before the gap, task-15 is back for its turn.
			clock.Set(t0.Add(800 * ms))
			back, err := throttle.Book(context.Background(), claims("task-15"), time.Time{}, time.Minute, throttle.MaxLate(100*ms))
			if err != nil || !back.Kept || !back.At.Equal(turns["task-15"].At) {
				t.Fatalf("task-15 back = %+v, %v; want its kept turn at %v", back, err, turns["task-15"].At.Sub(t0))
			}
			// Every turn is still booked: the next one after task-19's.
			if next := book(t, claims(""), time.Time{}, time.Minute); !next.At.Equal(turns["task-19"].At.Add(100 * ms)) {
				t.Errorf("the next turn at +%v, want +%v, after the 20 booked", next.At.Sub(t0), turns["task-19"].At.Add(100*ms).Sub(t0))
			}
		})
	}
}

// TestLargeStates (9.11): no call fails for the size of its state. A
// sliding log gives back a reservation of 9,000 events; a sliding counter of
// 1,000 sub-windows booked in every sub-window it books ahead keeps
// deciding; a reservation beyond what a limiter books ahead is refused, not
// an error; and a cost above the limit is ErrInvalidCost, not a call.
func TestLargeStates(t *testing.T) {
	ctx := context.Background()
	for _, e := range engines(t) {
		t.Run(e.name, func(t *testing.T) {
			log, _ := mustLimiter(t, e, throttle.Spec{Algorithm: throttle.SlidingLog, Limit: 10_000, Period: time.Minute})
			res, err := log.ReserveN(ctx, "big", 9_000, time.Second)
			if err != nil || !res.OK {
				t.Fatalf("reserving 9,000 events: %+v, %v", res, err)
			}
			if err := log.Cancel(ctx, "big", res); err != nil {
				t.Fatalf("giving back 9,000 events: %v", err)
			}
			if d := allow(t, log, "big", 10_000); !d.Allowed {
				t.Fatalf("after giving back 9,000 events, 10,000 = %+v; want allowed", d)
			}
			if _, err := log.AllowN(ctx, "big", 190_000); !errors.Is(err, throttle.ErrInvalidCost) {
				t.Fatalf("AllowN(190,000) on a limit of 10,000: %v, want ErrInvalidCost", err)
			}

			counter, clock := mustLimiter(t, e, throttle.Spec{Algorithm: throttle.SlidingCounter, Limit: 1_000_000, Period: time.Second, Windows: 1000})
			r := counter
			sub := time.Second / 1000
			for i := range 2000 {
				res, err := r.ReserveAfter(ctx, "wide", 1, t0.Add(time.Duration(i)*sub), time.Hour)
				if err != nil || !res.OK {
					t.Fatalf("reservation %d in its own sub-window: %+v, %v", i, res, err)
				}
			}
			res, err = r.ReserveAfter(ctx, "wide", 1, t0.Add(2100*sub), time.Hour)
			if err != nil || res.OK {
				t.Fatalf("reservation past what a counter books ahead: %+v, %v; want refused, no error", res, err)
			}
			clock.Set(t0.Add(500 * sub))
			start := time.Now()
			if d := allow(t, counter, "wide", 1); !d.Allowed {
				t.Fatalf("a call on the full-grown counter = %+v; want allowed", d)
			}
			t.Logf("one call on a sliding counter holding %d sub-windows: %v", 2000, time.Since(start))
		})
	}
}

// TestKeptTurnsOnTwoGates: tasks booked ahead on a drain and a quota (on a
// cluster, in two slots) and back, one after another, just before their turns
// get the turns they kept: none is booked anew at the end of the drain's
// line (which wastes the turn it held).
func TestKeptTurnsOnTwoGates(t *testing.T) {
	fastDrain := throttle.Spec{Algorithm: throttle.LeakyBucket, Limit: 20, Period: time.Second, Burst: 1}
	sharedQuota := throttle.Spec{Algorithm: throttle.TokenBucket, Limit: 40, Period: time.Second, Burst: 10}
	for _, e := range engines(t) {
		t.Run(e.name, func(t *testing.T) {
			clock := testkit.NewClock(t0)
			drain := mustNew(t, e, fastDrain, clock, "drain")
			quota := mustNew(t, e, sharedQuota, clock, "quota")
			claims := func(id string) []throttle.Claim {
				return []throttle.Claim{{Limiter: drain, Key: "q2", N: 1, ID: id}, {Limiter: quota, Key: "api", N: 1, ID: id}}
			}
			const n = 60
			turns := make([]time.Time, n)
			for i := range n {
				turns[i] = book(t, claims(fmt.Sprint("task-", i)), time.Time{}, time.Minute).At
			}
			for i := range n {
				if turns[i].Sub(t0) < 300*ms {
					continue
				}
				clock.Set(turns[i].Add(-300 * ms))
				back, err := throttle.Book(context.Background(), claims(fmt.Sprint("task-", i)), time.Time{}, time.Minute, throttle.MaxLate(0))
				if err != nil || !back.Kept || !back.At.Equal(turns[i]) {
					t.Fatalf("task-%d back 300ms before its turn at %v: %+v, %v; want its kept turn", i, turns[i].Sub(t0), back, err)
				}
			}
		})
	}
}

// TestDrainsShareAQuotaAtOnce: three drains (5, 10 and 20/s, burst 1)
// whose tasks share a quota of 40/s burst 10, each drain's tasks all
// booking at once from many callers, on Redis's clocks: every drain's turns
// are one interval apart from its first, with no gap, since the quota
// (35/s asked of 40/s) never binds. On a cluster the drains and the quota
// are in different slots. (The loss this guards against showed in
// TestSharedQuotaDrains on a loaded machine, where slots asked all at once
// answered tens of ms apart: the quota held a turn "now" for every task
// before moving it to the task's drain turn, such holds filled the quota,
// and other tasks' drains gave their turns up to the quota's later instant,
// where no one could use them. Here, unloaded, both protocols pass.)
func TestDrainsShareAQuotaAtOnce(t *testing.T) {
	rates := []int{5, 10, 20}
	quotaSpec := throttle.Spec{Algorithm: throttle.TokenBucket, Limit: 40, Period: time.Second, Burst: 10}
	for _, e := range engines(t) {
		t.Run(e.name, func(t *testing.T) {
			prefix := t.Name() + ":"
			quota, err := e.new(quotaSpec, throttle.WithPrefix(prefix+"quota:"))
			if err != nil {
				t.Fatal(err)
			}
			turns := make([][]time.Time, len(rates))
			var mu sync.Mutex
			var wg sync.WaitGroup
			for i, perSecond := range rates {
				drain, err := e.new(throttle.Spec{Algorithm: throttle.LeakyBucket, Limit: perSecond, Period: time.Second, Burst: 1},
					throttle.WithPrefix(fmt.Sprintf("%sdrain%d:", prefix, i)))
				if err != nil {
					t.Fatal(err)
				}
				claims := []throttle.Claim{{Limiter: drain, Key: "q", N: 1}, {Limiter: quota, Key: "api", N: 1}}
				for range 10 {
					wg.Go(func() {
						for range perSecond { // 10 callers: 10 s of turns
							at := book(t, claims, time.Time{}, time.Minute).At
							mu.Lock()
							turns[i] = append(turns[i], at)
							mu.Unlock()
						}
					})
				}
			}
			wg.Wait()
			for i, perSecond := range rates {
				got := turns[i]
				slices.SortFunc(got, time.Time.Compare)
				interval := time.Second / time.Duration(perSecond)
				if span := got[len(got)-1].Sub(got[0]); span > time.Duration(len(got)-1)*interval+ms {
					t.Errorf("drain %d/s: %d turns over %v, want one every %v (%v): turns lost", perSecond, len(got), span, interval, time.Duration(len(got)-1)*interval)
				}
			}
		})
	}
}
