package algorithms_test

import (
	"math/rand/v2"
	"reflect"
	"testing"

	"github.com/sluicehq/sluice/algorithms"
)

// TestSeriesIsBooksInTurn: Series on random states of every algorithm (one
// to three claims, turns booked ahead at random first) books what one Book
// per turn books, each with its ID, until one is refused or comes sooner
// than minAhead (which that Book's reference gives back), and leaves
// states that answer alike.
func TestSeriesIsBooksInTurn(t *testing.T) {
	const now = 1_800_000_000_000_000
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
		got := algorithms.Series(series, turns, now, notBefore, maxWait, minAhead)
		var want []algorithms.Booking
		for range turns {
			for i := range books {
				books[i].ID = "turn"
			}
			b := algorithms.Book(books, now, notBefore, maxWait, false, 0)
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
		}
		if len(got) != len(want) || len(got) > 0 && !reflect.DeepEqual(got, want) {
			t.Fatalf("seed %d: Series = %+v;\nBooks = %+v", seed, got, want)
		}
		for i := range series {
			s, b := series[i], books[i]
			for _, at := range []int64{now, now + period/3, now + 2*period, now + 7*period} {
				if s.State.Room(s.Params, at) != b.State.Room(b.Params, at) || s.State.Earliest(s.Params, at, s.N) != b.State.Earliest(b.Params, at, b.N) {
					t.Fatalf("seed %d, claim %d: the states answer apart at %d", seed, i, at)
				}
			}
		}
	}
}
