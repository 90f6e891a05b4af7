package throttle_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/internal/redistest"
	"github.com/sluicehq/sluice/internal/testkit"
	"github.com/sluicehq/sluice/throttle"
)

// seriesWorld is one set of limiters, one per claim, on one engine: the
// series, the sequential Books and the Go twin each book on a world of
// their own, which must stay alike.
type seriesWorld struct {
	name   string
	rdb    redis.UniversalClient // nil: local
	prefix string
	lims   []throttle.Reserver
	wake   string // the reminders' set
}

func (w *seriesWorld) claims(ns []int, id string) []throttle.Claim {
	claims := make([]throttle.Claim, len(w.lims))
	for i, lim := range w.lims {
		claims[i] = throttle.Claim{Limiter: lim, Key: "q", N: ns[i], ID: id}
	}
	return claims
}

// bookOneByOne is the reference a series must match: one Book per id,
// each with every claim's ID that id, until one is not OK or comes
// sooner than minAhead, which is given back. stop says which: "maxWait",
// "minAhead", or "" (every id booked).
func bookOneByOne(ctx context.Context, w *seriesWorld, ns []int, ids, members []string, notBefore time.Time, minAhead, maxWait time.Duration, opts []throttle.BookOption, lead, after time.Duration) (booked []throttle.Booking, stop string, err error) {
	for i, id := range ids {
		turnOpts := opts
		if members != nil {
			turnOpts = append(append([]throttle.BookOption{}, opts...), throttle.Remind(w.wake, members[i], lead, after))
		}
		claims := w.claims(ns, id)
		bk, err := throttle.Book(ctx, claims, notBefore, maxWait, turnOpts...)
		if err != nil {
			return nil, "", err
		}
		if !bk.OK {
			return booked, "maxWait", nil
		}
		if bk.Delay < minAhead {
			for k, c := range claims {
				if err := c.Limiter.(throttle.Reserver).Cancel(ctx, c.Key, bk.Turns[k]); err != nil {
					return nil, "", err
				}
			}
			if bk.Reminded {
				return nil, "", errors.New("a turn sooner than minAhead was noted: draw after >= minAhead")
			}
			return booked, "minAhead", nil
		}
		booked = append(booked, bk)
	}
	return booked, "", nil
}

// TestBookSeriesMatchesBooks: random claims (every algorithm, one to three
// claims in one slot, random limits and bursts, each with recent throttles
// or not), random earlier state (calls now, turns booked ahead, blocks,
// turns given back), then random series (length, notBefore, minAhead,
// maxWait, MaxLate, a reminder): the series on Redis (FCALL, EVALSHA, a
// cluster, miniredis), the series on the local engine (the Go twin,
// algorithms.Series) and one Book per id on Redis all book the same turns,
// decision for decision (instants, Remaining, ResetAfter, pieces,
// Reminded), keep the same turns under the same IDs, note the same
// reminders, and leave states on which the next calls decide alike. Once
// the turn a series stopped at is booked with Book, as its caller does,
// the series and the Books have counted the same recent throttles.
func TestBookSeriesMatchesBooks(t *testing.T) {
	mini := redis.NewClient(&redis.Options{Addr: miniredis.RunT(t).Addr(), ReadTimeout: time.Minute})
	t.Cleanup(func() { mini.Close() })
	remotes := append(engines(t)[1:], engine{name: "miniredis", rdb: mini})
	for _, e := range remotes {
		t.Run(e.name, func(t *testing.T) {
			// Each engine is a server of its own: side by side, not one
			// after another (make test runs this under the race detector).
			t.Parallel()
			// FCALL, the path of Redis 7, most; the other paths run the same
			// script text (EVALSHA) or the same calls slot by slot.
			seeds, algs := uint64(16), throttle.Algorithms
			switch e.name {
			case "redis-evalsha", "cluster":
				seeds = 8
			case "miniredis":
				// Its Lua is slow: the windowed algorithms' timelines take
				// minutes there (see TestRedisMatchesLocal).
				seeds, algs = 4, []throttle.Algorithm{throttle.TokenBucket, throttle.LeakyBucket, throttle.SlidingCounter}
			}
			var sum seriesTally
			for seed := uint64(1); seed <= seeds; seed++ {
				tally := seriesTimeline(t, e, seed, algs)
				sum.booked, sum.byWait, sum.byAhead, sum.throttled = sum.booked+tally.booked, sum.byWait+tally.byWait, sum.byAhead+tally.byAhead, sum.throttled+tally.throttled
			}
			if sum.booked < int(seeds)*10 || sum.byWait < int(seeds)/2 || sum.byAhead < int(seeds)/8 || sum.throttled < int(seeds)*2 {
				t.Fatalf("%+v: the timelines test too little", sum)
			}
		})
	}
}

// seriesTally is what one or more timelines tested: the turns booked,
// how many series stopped at maxWait and at minAhead, and how many series
// counted a recent throttle on some claim.
type seriesTally struct{ booked, byWait, byAhead, throttled int }

// seriesTimeline runs one seed's timeline on e.
func seriesTimeline(t *testing.T, e engine, seed uint64, algs []throttle.Algorithm) (tally seriesTally) {
	ctx := context.Background()
	rng := rand.New(rand.NewPCG(seed, 20))
	nclaims := 1 + rng.IntN(3)
	specs := make([]throttle.Spec, nclaims)
	ns := make([]int, nclaims)
	recent := make([]bool, nclaims)
	for i := range specs {
		specs[i] = randomSpec(rng, algs[rng.IntN(len(algs))])
		ns[i] = 1 + rng.IntN(min(3, capacityOf(specs[i])))
		recent[i] = rng.IntN(3) > 0
	}
	clock := testkit.NewClock(t0.Add(time.Duration(rng.Int64N(int64(time.Hour)))))
	world := func(name string, rdb redis.UniversalClient) *seriesWorld {
		w := &seriesWorld{name: name, rdb: rdb, prefix: redistest.Prefix(t)}
		w.wake = "{q}:" + w.prefix + "wake"
		for i, spec := range specs {
			opts := []throttle.Option{throttle.WithClock(clock), throttle.WithPrefix(fmt.Sprintf("%s%d:", w.prefix, i))}
			if recent[i] {
				opts = append(opts, throttle.WithRecentThrottles()) // NewLocal ignores it
			}
			var lim throttle.Reserver
			var err error
			if rdb == nil {
				lim, err = throttle.NewLocal(spec, opts...)
			} else {
				lim, err = throttle.New(rdb, spec, opts...)
			}
			if err != nil {
				t.Fatal(err)
			}
			w.lims = append(w.lims, lim)
		}
		return w
	}
	series, books, twin := world("series", e.rdb), world("books", e.rdb), world("twin", nil)
	worlds := []*seriesWorld{series, books, twin}
	fail := func(step int, format string, args ...any) {
		t.Helper()
		t.Fatalf("seed %d, specs %+v, n %v, step %d at %d: %s", seed, specs, ns, step, clock.Now().UnixMicro(), fmt.Sprintf(format, args...))
	}
	// throttledOf is what claim i of w throttled in the last minute.
	throttledOf := func(w *seriesWorld, i int) int {
		t.Helper()
		loads, err := throttle.Loads(ctx, w.lims[i])
		if err != nil {
			t.Fatalf("seed %d: Loads: %v", seed, err)
		}
		for _, l := range loads {
			if l.Key == "q" {
				return l.Throttled
			}
		}
		return 0
	}
	period := specs[0].Period
	given := make([][]throttle.Booking, len(worlds)) // per world: turns that may be given back
	turnID := 0
	for step := range 12 {
		clock.Set(clock.Now().Add(time.Duration(rng.Int64N(int64(period)))))
		// Earlier state: calls now, turns booked ahead, blocks, turns given back.
		for range rng.IntN(6) {
			switch op := rng.IntN(10); {
			case op < 6:
				turnID++
				id := ""
				if rng.IntN(2) == 0 {
					id = fmt.Sprint("ahead-", turnID)
				}
				notBefore := clock.Now().Add(time.Duration(rng.Int64N(3 * int64(period))))
				maxWait := time.Duration(rng.Int64N(4 * int64(period)))
				var got []throttle.Booking
				for k, w := range worlds {
					bk, err := throttle.Book(ctx, w.claims(ns, id), notBefore, maxWait)
					if err != nil {
						fail(step, "Book: %v", err)
					}
					got = append(got, bk)
					if bk.OK {
						given[k] = append(given[k], bk)
					}
				}
				if !reflect.DeepEqual(got[0], got[1]) || !reflect.DeepEqual(got[0], got[2]) {
					fail(step, "an earlier Book differs: %+v", got)
				}
			case op < 8 && len(given[0]) > 0:
				j := rng.IntN(len(given[0]))
				for k, w := range worlds {
					for i, lim := range w.lims {
						if err := lim.Cancel(ctx, "q", given[k][j].Turns[i]); err != nil {
							fail(step, "Cancel: %v", err)
						}
					}
					given[k] = append(given[k][:j], given[k][j+1:]...)
				}
			case op == 8:
				i, d := rng.IntN(nclaims), time.Duration(rng.Int64N(int64(period)))
				for _, w := range worlds {
					if err := w.lims[i].Block(ctx, "q", d); err != nil {
						fail(step, "Block: %v", err)
					}
				}
			}
		}
		// The series.
		n := rng.IntN(30)
		ids, members := make([]string, n), make([]string, n)
		for i := range ids {
			turnID++
			ids[i], members[i] = fmt.Sprint("turn-", turnID), fmt.Sprint("task-", turnID)
		}
		var notBefore time.Time
		if rng.IntN(2) == 0 {
			notBefore = clock.Now().Add(time.Duration(rng.Int64N(2*int64(period))) - period/2)
		}
		minAhead := time.Duration(0)
		if rng.IntN(3) > 0 {
			minAhead = time.Duration(rng.Int64N(int64(period)))
		}
		maxWait := minAhead + time.Duration(rng.Int64N(8*int64(period)))
		var opts []throttle.BookOption
		if rng.IntN(2) == 0 {
			opts = append(opts, throttle.MaxLate(time.Duration(rng.Int64N(int64(period)))))
		}
		reminded := rng.IntN(2) == 0
		lead, after := time.Duration(rng.Int64N(int64(period))), minAhead+time.Duration(rng.Int64N(2*int64(period)))
		before := make([]int, nclaims)
		for i := range before {
			before[i] = throttledOf(series, i)
		}
		var got [3][]throttle.Booking
		var stop string
		for k, w := range worlds {
			var err error
			if w == books {
				var m []string
				if reminded {
					m = members
				}
				got[k], stop, err = bookOneByOne(ctx, w, ns, ids, m, notBefore, minAhead, maxWait, opts, lead, after)
			} else {
				seriesOpts := opts
				if reminded {
					seriesOpts = append(append([]throttle.BookOption{}, opts...), throttle.RemindEach(w.wake, members, lead, after))
				}
				got[k], err = throttle.BookSeries(ctx, w.claims(ns, ""), ids, notBefore, minAhead, maxWait, seriesOpts...)
			}
			if err != nil {
				fail(step, "%s: %v", w.name, err)
			}
		}
		if !reflect.DeepEqual(got[0], got[1]) {
			fail(step, "series of %d (notBefore %v, minAhead %v, maxWait %v): series %+v, books %+v", n, notBefore, minAhead, maxWait, got[0], got[1])
		}
		// The local engine never notes reminders: the rest is alike.
		if len(got[2]) != len(got[0]) {
			fail(step, "series of %d: the twin booked %d, redis %d", n, len(got[2]), len(got[0]))
		}
		for i := range got[2] {
			twinTurn := got[2][i]
			twinTurn.Reminded = got[0][i].Reminded
			if !reflect.DeepEqual(twinTurn, got[0][i]) {
				fail(step, "turn %d: twin %+v, redis %+v", i, got[2][i], got[0][i])
			}
		}
		for i := range specs {
			if throttledOf(series, i) > before[i] {
				tally.throttled++
				break
			}
		}
		tally.booked += len(got[0])
		switch stop {
		case "maxWait":
			tally.byWait++
		case "minAhead":
			tally.byAhead++
		}
		for k := range worlds {
			given[k] = append(given[k], got[k]...)
		}
		// The caller books the turn a series stopped at with Book, as the
		// Books did (and gives it back, as they did): that Book counts its
		// recent throttles, which the series did not.
		if stop != "" {
			for _, w := range []*seriesWorld{series, twin} {
				claims := w.claims(ns, ids[len(got[0])])
				bk, err := throttle.Book(ctx, claims, notBefore, maxWait, opts...)
				if err != nil {
					fail(step, "%s: the Book of the turn the series stopped at: %v", w.name, err)
				}
				if bk.OK {
					for i, c := range claims {
						if err := c.Limiter.(throttle.Reserver).Cancel(ctx, c.Key, bk.Turns[i]); err != nil {
							fail(step, "Cancel: %v", err)
						}
					}
				}
			}
		}
		// The same recent throttles, claim by claim.
		for i := range specs {
			throttled := [2]int{throttledOf(series, i), throttledOf(books, i)}
			if throttled[0] != throttled[1] {
				fail(step, "claim %d (recent throttles %v), series of %d stopped at %q: throttled %d after the series, %d after the Books", i, recent[i], n, stop, throttled[0], throttled[1])
			}
			if !recent[i] && throttled[0] != 0 {
				fail(step, "claim %d without recent throttles counted %d", i, throttled[0])
			}
		}
		// The turns are kept under their IDs alike, the reminders noted alike.
		for i, id := range ids {
			var at [3]time.Time
			var ok [3]bool
			for k, w := range worlds {
				var err error
				if at[k], ok[k], err = throttle.KeptTurn(ctx, w.lims[0], "q", id); err != nil {
					fail(step, "KeptTurn: %v", err)
				}
			}
			if at != [3]time.Time{at[0], at[0], at[0]} || ok != [3]bool{ok[0], ok[0], ok[0]} {
				fail(step, "the turn kept under ids[%d]: %v %v", i, at, ok)
			}
		}
		if e.rdb != nil && reminded {
			var sets [2][]redis.Z
			for k, w := range worlds[:2] {
				sets[k] = w.rdb.ZRangeWithScores(ctx, w.wake, 0, -1).Val()
			}
			if !reflect.DeepEqual(sets[0], sets[1]) {
				fail(step, "reminders: series %v, books %v", sets[0], sets[1])
			}
		}
		// The states decide alike: a peek and a Book far ahead.
		for i := range specs {
			var levels [3]throttle.Level
			for k, w := range worlds {
				var err error
				if levels[k], err = w.lims[i].Peek(ctx, "q"); err != nil {
					fail(step, "Peek: %v", err)
				}
			}
			if levels[0] != levels[1] || levels[0] != levels[2] {
				fail(step, "claim %d after the series: Peek %+v", i, levels)
			}
		}
	}
	// The next Book after all of it, on each world.
	var last [3]throttle.Booking
	for k, w := range worlds {
		var err error
		if last[k], err = throttle.Book(ctx, w.claims(ns, ""), time.Time{}, 100*period); err != nil {
			fail(99, "Book: %v", err)
		}
	}
	if !reflect.DeepEqual(last[0], last[1]) || !reflect.DeepEqual(last[0], last[2]) {
		fail(99, "the next Book: %+v", last)
	}
	return tally
}

// TestBookSeriesKeptAndCancel: on every engine, the turns of a series on a
// drain of 25/s (burst 1) and a quota of 10/s (burst 5) in one slot are
// the drain's, 40ms apart, until the quota's 500ms of server time from
// now is taken (at +240ms), then 100ms apart at most; each is kept
// under its ID: a later Book of the claims with that ID gets it back
// (Kept, counting nothing), and Cancel of a turn by its Reservation gives
// it back once, however often it is called.
func TestBookSeriesKeptAndCancel(t *testing.T) {
	for _, e := range engines(t) {
		t.Run(e.name, func(t *testing.T) {
			ctx := context.Background()
			clock := testkit.NewClock(t0)
			drain := mustNew(t, e, drainSpec, clock, "drain")
			quota := mustNew(t, e, quotaSpec, clock, "quota")
			claims := func(id string) []throttle.Claim {
				return []throttle.Claim{{Limiter: drain, Key: "q", N: 1, ID: id}, {Limiter: quota, Key: "q", N: 1, ID: id}}
			}
			ids := []string{"t1", "t2", "t3", "t4", "t5", "t6", "t7"}
			got, err := throttle.BookSeries(ctx, claims(""), ids, time.Time{}, 10*ms, time.Second, throttle.MaxLate(50*ms))
			if err != nil {
				t.Fatal(err)
			}
			// Now is not booked (sooner than minAhead): the series books none.
			if len(got) != 0 {
				t.Fatalf("series with a turn free now and minAhead 10ms = %d turns; want none", len(got))
			}
			book(t, claims(""), time.Time{}, time.Second) // the turn now, as usual
			got, err = throttle.BookSeries(ctx, claims(""), ids, time.Time{}, 10*ms, time.Second, throttle.MaxLate(50*ms))
			if err != nil || len(got) != len(ids) {
				t.Fatalf("series = %d turns, %v; want %d", len(got), err, len(ids))
			}
			// The quota's turns take 100ms each of its server time from now
			// on; one fits at x while 100ms of [x, x+500ms) are free.
			want := []time.Duration{40 * ms, 80 * ms, 120 * ms, 160 * ms, 200 * ms, 240 * ms, 300 * ms}
			for i, bk := range got {
				if !bk.OK || bk.Kept || bk.Delay != want[i] || !bk.At.Equal(t0.Add(want[i])) || bk.Turns[0].ID != ids[i] {
					t.Fatalf("turn %d = %+v; want OK at +%v under %q", i, bk, want[i], ids[i])
				}
			}
			if r := got[1].Turns[1]; r.Remaining != 2 {
				t.Fatalf("the quota's turn at +80ms has %d remaining; want 2 (its time taken up to +300ms: 280ms of [80ms, 580ms) free)", r.Remaining)
			}
			// t3 back for its turn: given it, nothing counted.
			clock.Set(t0.Add(120 * ms))
			back := book(t, claims("t3"), time.Time{}, time.Second)
			if !back.OK || !back.Kept || !back.At.Equal(got[2].At) {
				t.Fatalf("t3 back at its turn = %+v; want its kept turn at +120ms", back)
			}
			// t5's turn given back, twice: the next Book takes it, once.
			for range 2 {
				for i, c := range claims("") {
					if err := c.Limiter.(throttle.Reserver).Cancel(ctx, c.Key, got[4].Turns[i]); err != nil {
						t.Fatal(err)
					}
				}
			}
			next := book(t, claims("x"), time.Time{}, time.Second)
			after := book(t, claims("y"), time.Time{}, time.Second)
			if !next.At.Equal(got[4].At) || !after.At.Equal(t0.Add(400*ms)) {
				t.Fatalf("after t5's turn was given back twice: turns at +%v and +%v; want +200ms, then +400ms", next.At.Sub(t0), after.At.Sub(t0))
			}
		})
	}
}

// TestBookSeriesStops: a series stops at the first turn beyond maxWait or
// sooner than minAhead, and counts nothing for it and the rest: the next
// Book gets that turn.
func TestBookSeriesStops(t *testing.T) {
	for _, e := range engines(t) {
		t.Run(e.name, func(t *testing.T) {
			ctx := context.Background()
			clock := testkit.NewClock(t0)
			drain := mustNew(t, e, drainSpec, clock, "drain")
			claims := []throttle.Claim{{Limiter: drain, Key: "q", N: 1}}
			ids := func(prefix string, n int) []string {
				s := make([]string, n)
				for i := range s {
					s[i] = fmt.Sprint(prefix, i)
				}
				return s
			}
			// At maxWait 100ms: the turns at +0 (minAhead 0), +40 and +80ms.
			got, err := throttle.BookSeries(ctx, claims, ids("a", 10), time.Time{}, 0, 100*ms)
			if err != nil || len(got) != 3 || got[0].Delay != 0 || got[2].Delay != 80*ms {
				t.Fatalf("series with maxWait 100ms = %+v, %v; want turns at +0, +40 and +80ms", got, err)
			}
			if next := book(t, claims, time.Time{}, time.Second); next.Delay != 120*ms {
				t.Fatalf("the next Book = %+v; want +120ms: the series counted nothing past maxWait", next)
			}
			// At +150ms the next free turn is +160ms, 10ms away: sooner
			// than minAhead 20ms, so the series stops there, counting nothing.
			clock.Set(t0.Add(150 * ms))
			got, err = throttle.BookSeries(ctx, claims, ids("b", 10), time.Time{}, 20*ms, time.Second)
			if err != nil || len(got) != 0 {
				t.Fatalf("series whose first turn is 10ms away, minAhead 20ms = %+v, %v; want none", got, err)
			}
			if next := book(t, claims, time.Time{}, time.Second); next.Delay != 10*ms {
				t.Fatalf("the next Book = %+v; want +10ms (at +160ms): the series counted nothing", next)
			}
			// notBefore puts them all further off.
			got, err = throttle.BookSeries(ctx, claims, ids("c", 2), t0.Add(time.Second), 20*ms, 2*time.Second)
			if err != nil || len(got) != 2 || !got[0].At.Equal(t0.Add(time.Second)) || !got[1].At.Equal(t0.Add(1040*ms)) {
				t.Fatalf("series not before +1s = %+v, %v; want +1s and +1.04s", got, err)
			}
		})
	}
}

// TestBookSeriesMisuse: what a series cannot act on is refused with an
// error that wraps ErrMisuse and names the problem, before anything is
// counted.
func TestBookSeriesMisuse(t *testing.T) {
	ctx := context.Background()
	clock := testkit.NewClock(t0)
	drain, err := throttle.NewLocal(drainSpec, throttle.WithClock(clock))
	if err != nil {
		t.Fatal(err)
	}
	claims := []throttle.Claim{{Limiter: drain, Key: "q", N: 1}}
	many := make([]string, throttle.MaxSeries+1)
	for i := range many {
		many[i] = fmt.Sprint(i)
	}
	for _, c := range []struct {
		desc     string
		claims   []throttle.Claim
		ids      []string
		minAhead time.Duration
		maxWait  time.Duration
		opts     []throttle.BookOption
		want     string
	}{
		{desc: "negative maxWait", claims: claims, ids: []string{"a"}, maxWait: -1, want: "maxWait must be >= 0"},
		{desc: "negative minAhead", claims: claims, ids: []string{"a"}, minAhead: -1, want: "minAhead must be >= 0"},
		{desc: "empty id", claims: claims, ids: []string{"a", ""}, want: "ids[1] is empty"},
		{desc: "repeated id", claims: claims, ids: []string{"a", "b", "a"}, want: `ids[0] and ids[2] are both "a"`},
		{desc: "too many ids", claims: claims, ids: many, want: "at most 1024 ids"},
		{desc: "no claims", ids: []string{"a"}, want: "no claims"},
		{desc: "a claim's own ID", claims: []throttle.Claim{{Limiter: drain, Key: "q", N: 1, ID: "x"}}, ids: []string{"a"}, want: `claim 0 has ID "x"`},
		{desc: "Remind", claims: claims, ids: []string{"a"}, opts: []throttle.BookOption{throttle.Remind("w", "m", 0, 0)}, want: "RemindEach"},
		{desc: "members of RemindEach", claims: claims, ids: []string{"a", "b"}, opts: []throttle.BookOption{throttle.RemindEach("w", []string{"m"}, 0, 0)}, want: "1 members for 2 ids"},
		{desc: "KeepAfter", claims: claims, ids: []string{"a"}, opts: []throttle.BookOption{throttle.KeepAfter(time.Second)}, want: "KeepAfter is Book's"},
		{desc: "RecentRefusalsOnly", claims: claims, ids: []string{"a"}, opts: []throttle.BookOption{throttle.RecentRefusalsOnly()}, want: "RecentRefusalsOnly is Book's"},
	} {
		t.Run(c.desc, func(t *testing.T) {
			got, err := throttle.BookSeries(ctx, c.claims, c.ids, time.Time{}, c.minAhead, c.maxWait, c.opts...)
			if !errors.Is(err, throttle.ErrMisuse) || !strings.Contains(err.Error(), c.want) || got != nil {
				t.Fatalf("= %v, %v; want ErrMisuse saying %q", got, err, c.want)
			}
		})
	}
	if _, err := throttle.Book(ctx, claims, time.Time{}, 0, throttle.RemindEach("w", nil, 0, 0)); !errors.Is(err, throttle.ErrMisuse) {
		t.Fatalf("Book with RemindEach: %v; want ErrMisuse", err)
	}
	if d := allow(t, drain, "q", 1); !d.Allowed {
		t.Fatalf("after the refused series, AllowN = %+v; want allowed: nothing was counted", d)
	}
}

// TestBookSeriesSlots: on a cluster, claims in two slots are booked one
// Book per id, with the same turns as those Books give on twin limiters
// and no reminder (no one script run reaches the set); claims in one slot
// with the set in another book in one run, without reminders.
func TestBookSeriesSlots(t *testing.T) {
	ctx := context.Background()
	e := engines(t)[3]
	if e.name != "cluster" {
		t.Fatalf("engine %s, want the cluster", e.name)
	}
	clock := testkit.NewClock(t0)
	wake := "{q}:" + redistest.Prefix(t) + "wake"
	type pair struct{ drain, quota throttle.Reserver }
	series := pair{mustNew(t, e, drainSpec, clock, "s-drain"), mustNew(t, e, quotaSpec, clock, "s-quota")}
	books := pair{mustNew(t, e, drainSpec, clock, "b-drain"), mustNew(t, e, quotaSpec, clock, "b-quota")}
	claims := func(p pair, id string) []throttle.Claim {
		return []throttle.Claim{{Limiter: p.drain, Key: "q", N: 1, ID: id}, {Limiter: p.quota, Key: "api", N: 1, ID: id}}
	}
	ids := []string{"t1", "t2", "t3", "t4", "t5", "t6", "t7", "t8"}
	members := []string{"m1", "m2", "m3", "m4", "m5", "m6", "m7", "m8"}
	book(t, claims(series, ""), time.Time{}, time.Second)
	book(t, claims(books, ""), time.Time{}, time.Second)
	got, err := throttle.BookSeries(ctx, claims(series, ""), ids, time.Time{}, 10*ms, 350*ms, throttle.RemindEach(wake, members, 0, 0))
	if err != nil {
		t.Fatal(err)
	}
	var want []throttle.Booking
	for _, id := range ids {
		bk := book(t, claims(books, id), time.Time{}, 350*ms)
		if !bk.OK {
			break
		}
		want = append(want, bk)
	}
	if len(got) != 7 || !reflect.DeepEqual(got, want) {
		t.Fatalf("series on two slots = %+v;\nwant %+v (7 turns, up to +300ms)", got, want)
	}
	for i, bk := range got {
		if bk.Reminded {
			t.Fatalf("turn %d on two slots says it was noted", i)
		}
	}
	if n := e.rdb.Exists(ctx, wake).Val(); n != 0 {
		t.Fatalf("a series on two slots wrote the reminders' set")
	}
	// One slot, the set in another: booked, not noted.
	drain := mustNew(t, e, drainSpec, clock, "one-slot")
	elsewhere := "{elsewhere}:" + redistest.Prefix(t) + "wake"
	got, err = throttle.BookSeries(ctx, []throttle.Claim{{Limiter: drain, Key: "q", N: 1}}, ids[:3], time.Time{}, 0, time.Second, throttle.RemindEach(elsewhere, members[:3], 0, 0))
	if err != nil || len(got) != 3 || got[2].Reminded || got[2].Delay != 80*ms {
		t.Fatalf("series in one slot, the set in another = %+v, %v; want 3 turns, none noted", got, err)
	}
	if n := e.rdb.Exists(ctx, elsewhere).Val(); n != 0 {
		t.Fatalf("the set in another slot was written")
	}
}

// TestBookSeriesRedisFails: a series whose Redis fails returns the error
// and no bookings, whatever its limiters' failure policy (allow and local
// too): its caller books the tasks one by one, where the policies apply.
func TestBookSeriesRedisFails(t *testing.T) {
	ctx := context.Background()
	clock := testkit.NewClock(t0)
	newDead := deadLimiters(t, clock)
	for _, policy := range []string{throttle.OnRedisErrorDeny, throttle.OnRedisErrorAllow, throttle.OnRedisErrorLocal} {
		t.Run(policy, func(t *testing.T) {
			claims := []throttle.Claim{{Limiter: newDead(policy), Key: "q", N: 1}}
			got, err := throttle.BookSeries(ctx, claims, []string{"a", "b"}, time.Time{}, 0, time.Second)
			if err == nil || got != nil || !strings.Contains(err.Error(), "BookSeries booked nothing") {
				t.Fatalf("series on a dead Redis = %+v, %v; want no bookings and the error", got, err)
			}
			if _, err := throttle.Book(ctx, []throttle.Claim{{Limiter: claims[0].Limiter, Key: "q", N: 1, ID: "a"}}, time.Time{}, time.Second); (err != nil) != (policy == throttle.OnRedisErrorDeny) {
				t.Fatalf("the Book one by one after it: %v; want the %s policy's outcome", err, policy)
			}
		})
	}
}

// TestBookSeriesLostReply: a series whose reply is lost may have run: it
// returns the error, and the Books one by one that follow get the turns
// it booked back under their IDs (Kept), counting nothing twice (its
// minAhead above 0: a turn at now would not be kept).
func TestBookSeriesLostReply(t *testing.T) {
	ctx := context.Background()
	for name, p := range lossyPairs(t, drainSpec, "q") {
		t.Run(name, func(t *testing.T) {
			ids := []string{"t1", "t2", "t3"}
			claims := func(lim throttle.Reserver, id string) []throttle.Claim {
				return []throttle.Claim{{Limiter: lim, Key: "q", N: 1, ID: id}}
			}
			book(t, claims(p.direct, ""), time.Time{}, time.Second) // the turn now
			p.loseNext(t)
			if got, err := throttle.BookSeries(ctx, claims(p.lossy, ""), ids, time.Time{}, time.Millisecond, time.Second); err == nil || got != nil {
				t.Fatalf("series whose reply was lost = %+v, %v; want an error", got, err)
			}
			for i, id := range ids {
				bk := book(t, claims(p.direct, id), time.Time{}, time.Second)
				if !bk.OK || bk.Delay != time.Duration(i+1)*40*ms || !bk.Kept {
					t.Fatalf("%s booked one by one = %+v; want the turn the series kept, +%v", id, bk, time.Duration(i+1)*40*ms)
				}
			}
		})
	}
}

// TestBookSeriesCommands counts the Redis commands (INFO commandstats,
// those scripts call included) of 256 turns booked by 256 Books, each
// with its ID as the parker books a task, and by one BookSeries, on
// Redis's clock, on a server of its own: on one claim (a drain of 25/s),
// without and with recent throttles (every turn after the first is one,
// a GET and a SET of its count in each Book, once in the series), and two
// in one slot (the drain and a quota of 100/s, which the drain's
// turns keep within), with and without a reminder per turn; and on the
// drain and a quota slower than it (10/s, burst 5). A quota's turns
// booked ahead 40ms apart are a span each in its sorted set of spans (and
// the slower quota's leave the drain's bucket a span per turn too), which
// each turn's search reads, in a series as in a Book: the series saves
// the script call, TIME, the GETs and writes of the states and of the
// kept turns, not those reads. It logs the table, and holds a series on
// one claim to 1.1 commands a turn (one SET of each kept turn; the rest
// once), and on two to 9 a turn fewer than Books.
func TestBookSeriesCommands(t *testing.T) {
	ctx := context.Background()
	rdb := redis.NewClient(&redis.Options{Addr: redistest.StartServer(t, "--appendonly", "no").Addr})
	t.Cleanup(func() { rdb.Close() })
	const turns = 256
	commands := func() (total int64, by map[string]int64) {
		by = map[string]int64{}
		for _, line := range strings.Split(rdb.Info(ctx, "commandstats").Val(), "\n") {
			name, rest, ok := strings.Cut(strings.TrimPrefix(line, "cmdstat_"), ":calls=")
			if !ok || name == "info" || name == "config|resetstat" {
				continue
			}
			calls, _, _ := strings.Cut(rest, ",")
			var n int64
			fmt.Sscan(calls, &n)
			by[name], total = n, total+n
		}
		return total, by
	}
	roomyQuota := throttle.Spec{Algorithm: throttle.TokenBucket, Limit: 100, Period: time.Second, Burst: 10}
	run := 0
	measure := func(claimsN int, remind, slowQuota, recent, series bool) (perTurn float64, by map[string]int64) {
		run++
		prefix := fmt.Sprintf("%sr%d:", redistest.Prefix(t), run)
		specs := []throttle.Spec{drainSpec, roomyQuota}[:claimsN]
		if slowQuota {
			specs[1] = quotaSpec
		}
		var claims []throttle.Claim
		for i, spec := range specs {
			opts := []throttle.Option{throttle.WithPrefix(fmt.Sprintf("%s%d:", prefix, i))}
			if recent {
				opts = append(opts, throttle.WithRecentThrottles())
			}
			lim, err := throttle.New(rdb, spec, opts...)
			if err != nil {
				t.Fatal(err)
			}
			claims = append(claims, throttle.Claim{Limiter: lim, Key: "q", N: 1})
		}
		ids, members := make([]string, turns), make([]string, turns)
		for i := range ids {
			ids[i], members[i] = fmt.Sprint("booking-", i), fmt.Sprint("task-", i)
		}
		wake := "{q}:" + prefix + "wake"
		// The turn now, then the library loaded: neither counted.
		if _, err := throttle.Book(ctx, claims, time.Time{}, 0); err != nil {
			t.Fatal(err)
		}
		if _, err := throttle.BookSeries(ctx, claims, []string{"warm"}, time.Time{}, ms, time.Minute); err != nil {
			t.Fatal(err)
		}
		rdb.ConfigResetStat(ctx)
		booked := 0
		if series {
			var opts []throttle.BookOption
			opts = append(opts, throttle.MaxLate(time.Second))
			if remind {
				opts = append(opts, throttle.RemindEach(wake, members, 0, 0))
			}
			got, err := throttle.BookSeries(ctx, claims, ids, time.Time{}, ms, time.Minute, opts...)
			if err != nil {
				t.Fatal(err)
			}
			booked = len(got)
		} else {
			for i, id := range ids {
				opts := []throttle.BookOption{throttle.MaxLate(time.Second)}
				if remind {
					opts = append(opts, throttle.Remind(wake, members[i], 0, 0))
				}
				turn := slices.Clone(claims)
				for k := range turn {
					turn[k].ID = id
				}
				bk, err := throttle.Book(ctx, turn, time.Time{}, time.Minute, opts...)
				if err != nil || !bk.OK {
					t.Fatalf("Book %d = %+v, %v", i, bk, err)
				}
				booked++
			}
		}
		if booked != turns {
			t.Fatalf("%d turns booked, want %d", booked, turns)
		}
		total, by := commands()
		return float64(total) / turns, by
	}
	t.Logf("Redis commands per turn, %d turns (INFO commandstats, scripts' commands included):", turns)
	t.Logf("%-28s %8s %8s", "", "Books", "series")
	for _, c := range []struct {
		desc                 string
		claims               int
		remind, slow, recent bool
	}{
		{"one claim", 1, false, false, false}, {"one claim, reminded", 1, true, false, false},
		{"one claim, recent throttles", 1, false, false, true},
		{"two claims", 2, false, false, false}, {"two claims, reminded", 2, true, false, false},
		{"two claims, slower quota", 2, true, true, false},
	} {
		books, byBook := measure(c.claims, c.remind, c.slow, c.recent, false)
		series, bySeries := measure(c.claims, c.remind, c.slow, c.recent, true)
		t.Logf("%-28s %8.2f %8.2f   Books %v; series %v", c.desc, books, series, byBook, bySeries)
		if c.claims == 1 && series > 1.1 {
			t.Errorf("%s: a series costs %.2f commands a turn; want at most 1.1", c.desc, series)
		}
		if c.claims == 2 && series > books-9 {
			t.Errorf("%s: a series costs %.2f commands a turn, Books %.2f; want 9 fewer", c.desc, series, books)
		}
	}
}
