package algorithms_test

import (
	"math/rand/v2"
	"reflect"
	"slices"
	"testing"

	"github.com/sluicehq/sluice/algorithms"
)

// TestSeriesIsBooksInTurn: Series on random states of every algorithm (one
// to three claims, turns booked ahead at random first) books what one Book
// per turn books, each with its ID, until one is refused or comes sooner
// than minAhead (which that Book's reference gives back), counts as
// throttled per claim what those Books' own-limit refusals come to (a
// claim alone booked later than the start: book.lua's recent throttle),
// the turn it stops at not included, and leaves states that answer alike.
func TestSeriesIsBooksInTurn(t *testing.T) {
	const now = 1_800_000_000_000_000
	var throttledSeeds int64
	for seed := uint64(1); seed <= 300; seed++ {
		rng := rand.New(rand.NewPCG(seed, 7))
		k := 1 + rng.IntN(3)
		series, books := make([]algorithms.Claim, k), make([]algorithms.Claim, k)
		for i := range k {
			a := algorithms.All[rng.IntN(len(algorithms.All))]
			p := algorithms.Params{Limit: 1 + rng.Int64N(8), Period: []int64{1000, 10_000, 100_000}[rng.IntN(3)], Windows: 1}
			p.Burst = 1 + rng.Int64N(8)
			n := 1 + rng.Int64N(min(p.Limit, p.Burst))
			series[i] = algorithms.Claim{State: a.NewState(), Params: p, N: n}
			books[i] = algorithms.Claim{State: a.NewState(), Params: p, N: n}
			for range rng.IntN(6) {
				at := now - p.Period + rng.Int64N(3*p.Period)
				if series[i].State.Earliest(p, at, n) == at {
					series[i].State.Record(p, at, n)
					books[i].State.Record(p, at, n)
				}
			}
		}
		period := series[0].Params.Period
		notBefore, maxWait, minAhead := now+rng.Int64N(period)-period/2, rng.Int64N(10*period), rng.Int64N(period)*int64(rng.IntN(2))
		turns := rng.IntN(20)
		got, gotThrottled := algorithms.Series(series, turns, now, notBefore, maxWait, minAhead)
		var want []algorithms.Booking
		wantThrottled := make([]int64, k)
		for range turns {
			// Each claim alone, given back at once: book.lua counts a
			// recent throttle where it would come later than the start.
			alone := make([]bool, k)
			for i, c := range books {
				solo := algorithms.Book([]algorithms.Claim{{State: c.State, Params: c.Params, N: c.N}}, now, notBefore, maxWait, false, 0, 0)
				alone[i] = solo.At > max(now, notBefore)
				if solo.OK {
					c.State.GiveBack(c.Params, solo.Claims[0].Pieces, c.N)
				}
			}
			for i := range books {
				books[i].ID = "turn"
			}
			b := algorithms.Book(books, now, notBefore, maxWait, false, 0, 0)
			if !b.OK {
				break
			}
			if b.At-now < minAhead {
				for i, c := range books {
					c.State.GiveBack(c.Params, b.Claims[i].Pieces, c.N)
				}
				break
			}
			want = append(want, b)
			for i, c := range books {
				if alone[i] {
					wantThrottled[i] += c.N
				}
			}
		}
		if len(got) != len(want) || len(got) > 0 && !reflect.DeepEqual(got, want) {
			t.Fatalf("seed %d: Series = %+v;\nBooks = %+v", seed, got, want)
		}
		if !reflect.DeepEqual(gotThrottled, wantThrottled) {
			t.Fatalf("seed %d: Series throttled %v, Books %v", seed, gotThrottled, wantThrottled)
		}
		throttledSeeds += min(1, slices.Max(wantThrottled))
		for i := range series {
			s, b := series[i], books[i]
			for _, at := range []int64{now, now + period/3, now + 2*period, now + 7*period} {
				if s.State.Room(s.Params, at) != b.State.Room(b.Params, at) || s.State.Earliest(s.Params, at, s.N) != b.State.Earliest(b.Params, at, b.N) {
					t.Fatalf("seed %d, claim %d: the states answer apart at %d", seed, i, at)
				}
			}
		}
	}
	if throttledSeeds < 100 {
		t.Fatalf("%d seeds of 300 counted a throttle: the states test too little of it", throttledSeeds)
	}
}
