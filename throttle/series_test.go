package throttle_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"reflect"
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
// claims in one slot, random limits and bursts), random earlier state
// (calls now, turns booked ahead, blocks, turns given back), then random
// series (length, notBefore, minAhead, maxWait, MaxLate, a reminder): the
// series on Redis (FCALL, EVALSHA, a cluster, miniredis), the series on
// the local engine (the Go twin, algorithms.Series) and one Book per id on
// Redis all book the same turns, decision for decision (instants,
// Remaining, ResetAfter, pieces, Reminded), keep the same turns under the
// same IDs, note the same reminders, and leave states on which the next
// calls decide alike.
func TestBookSeriesMatchesBooks(t *testing.T) {
	mini := redis.NewClient(&redis.Options{Addr: miniredis.RunT(t).Addr(), ReadTimeout: time.Minute})
	t.Cleanup(func() { mini.Close() })
	remotes := append(engines(t)[1:], engine{name: "miniredis", rdb: mini})
	for _, e := range remotes {
		t.Run(e.name, func(t *testing.T) {
			seeds, algs := uint64(40), throttle.Algorithms
			if e.name == "miniredis" {
				// Its Lua is slow: the windowed algorithms' timelines take
				// minutes there (see TestRedisMatchesLocal).
				seeds, algs = 12, []throttle.Algorithm{throttle.TokenBucket, throttle.LeakyBucket, throttle.SlidingCounter}
			}
			var booked, stoppedByWait, stoppedByAhead int
			for seed := uint64(1); seed <= seeds; seed++ {
				b, w, a := seriesTimeline(t, e, seed, algs)
				booked, stoppedByWait, stoppedByAhead = booked+b, stoppedByWait+w, stoppedByAhead+a
			}
			t.Logf("%d turns booked, %d series stopped at maxWait, %d at minAhead", booked, stoppedByWait, stoppedByAhead)
			if booked < int(seeds)*10 || stoppedByWait < int(seeds)/2 || stoppedByAhead < int(seeds)/8 {
				t.Fatalf("%d turns booked, %d series stopped at maxWait, %d at minAhead: the timelines test too little", booked, stoppedByWait, stoppedByAhead)
			}
		})
	}
}

// seriesTimeline runs one seed's timeline on e; it returns the turns
// booked and how many series stopped at maxWait and at minAhead.
func seriesTimeline(t *testing.T, e engine, seed uint64, algs []throttle.Algorithm) (booked, byWait, byAhead int) {
	ctx := context.Background()
	rng := rand.New(rand.NewPCG(seed, 20))
	nclaims := 1 + rng.IntN(3)
	specs := make([]throttle.Spec, nclaims)
	ns := make([]int, nclaims)
	for i := range specs {
		specs[i] = randomSpec(rng, algs[rng.IntN(len(algs))])
		ns[i] = 1 + rng.IntN(min(3, capacityOf(specs[i])))
	}
	clock := testkit.NewClock(t0.Add(time.Duration(rng.Int64N(int64(time.Hour)))))
	world := func(name string, rdb redis.UniversalClient) *seriesWorld {
		w := &seriesWorld{name: name, rdb: rdb, prefix: redistest.Prefix(t)}
		w.wake = "{q}:" + w.prefix + "wake"
		for i, spec := range specs {
			opts := []throttle.Option{throttle.WithClock(clock), throttle.WithPrefix(fmt.Sprintf("%s%d:", w.prefix, i))}
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
	period := specs[0].Period
	var given [][]throttle.Booking // per world: turns that may be given back
	given = make([][]throttle.Booking, len(worlds))
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
		booked += len(got[0])
		switch stop {
		case "maxWait":
			byWait++
		case "minAhead":
			byAhead++
		}
		for k := range worlds {
			given[k] = append(given[k], got[k]...)
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
	return booked, byWait, byAhead
}
