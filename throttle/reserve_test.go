package throttle_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/sluicehq/sluice/throttle"
)

func reserve(t *testing.T, lim throttle.Limiter, n int, maxWait time.Duration) throttle.Reservation {
	t.Helper()
	r, err := lim.(throttle.Reserver).ReserveN(context.Background(), "k", n, maxWait)
	if err != nil {
		t.Fatalf("ReserveN(n=%d, %v): %v", n, maxWait, err)
	}
	return r
}

// TestReservationsQueueUp: a leaky bucket of 10/s and Burst 1 gives waiters
// one turn each, 100ms apart; a plain call is told to wait for all of them;
// a reservation beyond maxWait counts nothing; a cancelled last turn goes to
// the next waiter.
func TestReservationsQueueUp(t *testing.T) {
	for _, e := range engines(t) {
		t.Run(e.name, func(t *testing.T) {
			lim, clock := mustLimiter(t, e, throttle.Spec{Algorithm: throttle.LeakyBucket, Limit: 10, Period: time.Second, Burst: 1})
			for i := 0; i < 5; i++ {
				r := reserve(t, lim, 1, time.Second)
				if want := time.Duration(i) * 100 * ms; !r.OK || r.Delay != want || !r.At.Equal(t0.Add(want)) {
					t.Fatalf("reservation %d = %+v, want OK with Delay %v", i, r, want)
				}
			}
			if d := allow(t, lim, "k", 1); d.Allowed || d.RetryAfter != 500*ms {
				t.Fatalf("plain call behind 5 turns = %+v, want denied for 500ms", d)
			}
			if r := reserve(t, lim, 1, 499*ms); r.OK || r.Delay != 500*ms {
				t.Fatalf("reservation beyond maxWait = %+v, want not OK with Delay 500ms", r)
			}
			last := reserve(t, lim, 1, time.Second)
			if !last.OK || last.Delay != 500*ms {
				t.Fatalf("reservation after a refused one = %+v, want Delay 500ms: the refusal counted something", last)
			}
			if err := lim.Cancel(context.Background(), "k", last); err != nil {
				t.Fatal(err)
			}
			if r := reserve(t, lim, 1, time.Second); !r.OK || r.Delay != 500*ms {
				t.Fatalf("reservation after a cancelled last turn = %+v, want that turn (500ms)", r)
			}
			// At its turn a reservation's holder acts without asking again;
			// the turn is not offered to anyone else.
			clock.Set(t0.Add(500 * ms))
			if d := allow(t, lim, "k", 1); d.Allowed {
				t.Fatalf("plain call at a reserved turn allowed: %+v", d)
			}
		})
	}
}

// TestReservationsOnEveryAlgorithm: once full, each algorithm books the
// next turn exactly where a plain call would be told to retry, and the
// following plain call must wait past it.
func TestReservationsOnEveryAlgorithm(t *testing.T) {
	forEach(t, func(t *testing.T, e engine, a throttle.Algorithm) {
		lim, _ := fivePerSecondOn(t, e, a)
		allow(t, lim, "k", 5)
		denied := allow(t, lim, "k", 1)
		r := reserve(t, lim, 1, 2*time.Second)
		if !r.OK || r.Delay != denied.RetryAfter {
			t.Fatalf("reservation = %+v, want OK at the refusal's RetryAfter %v", r, denied.RetryAfter)
		}
		if d := allow(t, lim, "k", 1); d.Allowed || d.RetryAfter < r.Delay {
			t.Fatalf("plain call after a reservation at +%v = %+v, want denied until at least then", r.Delay, d)
		}
		if _, err := lim.ReserveN(context.Background(), "k", 1, -time.Second); !errors.Is(err, throttle.ErrMisuse) {
			t.Fatalf("ReserveN with a negative maxWait: %v, want ErrMisuse", err)
		}
		if err := lim.Cancel(context.Background(), "k", throttle.Reservation{N: 1}); !errors.Is(err, throttle.ErrMisuse) {
			t.Fatalf("Cancel of a reservation that is not OK: %v, want ErrMisuse", err)
		}
	})
}

// TestBlock: a blocked key admits nothing until the block ends, books
// reservations after it, and a shorter block does not cut a longer one.
func TestBlock(t *testing.T) {
	forEach(t, func(t *testing.T, e engine, a throttle.Algorithm) {
		lim, clock := fivePerSecondOn(t, e, a)
		r := lim
		ctx := context.Background()
		if err := r.Block(ctx, "k", 2*time.Second); err != nil {
			t.Fatal(err)
		}
		if err := r.Block(ctx, "k", time.Second); err != nil {
			t.Fatal(err)
		}
		if d := allow(t, lim, "k", 1); d.Allowed || d.RetryAfter != 2*time.Second {
			t.Fatalf("AllowN on a blocked key = %+v, want denied for 2s", d)
		}
		if res := reserve(t, lim, 1, 3*time.Second); !res.OK || res.Delay != 2*time.Second {
			t.Fatalf("ReserveN on a blocked key = %+v, want its turn when the block ends", res)
		}
		clock.Set(t0.Add(2 * time.Second))
		if d := allow(t, lim, "k", 4); !d.Allowed {
			t.Fatalf("AllowN after the block = %+v, want allowed", d)
		}
	})
}
