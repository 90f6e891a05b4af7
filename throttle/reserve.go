package throttle

import (
	"context"
	"fmt"
	"time"
)

// Reserver is a Limiter that can also book the earliest turn of events that
// do not fit now. The limiters New and NewLocal return implement it.
//
// A reservation is counted at once, at its turn: callers after it see it,
// so a queue of waiters gets one turn each instead of all coming back
// together. A reservation that will not be used must be given back with
// Cancel, or its turn is lost to everyone.
type Reserver interface {
	Limiter
	// ReserveN counts n events for key now if they fit, or else at the
	// earliest instant they fit if that is at most maxWait away. A
	// reservation that is not OK counted nothing.
	ReserveN(ctx context.Context, key string, n int, maxWait time.Duration) (Reservation, error)
	// ReserveAfter is ReserveN with the events counted no earlier than
	// notBefore (on the limiter's clock), so that several limits can give
	// one caller the same turn. ReserveN is shorthand for ReserveAfter with
	// the zero Time.
	ReserveAfter(ctx context.Context, key string, n int, notBefore time.Time, maxWait time.Duration) (Reservation, error)
	// Cancel gives back the events of an OK reservation for key. Buckets
	// take back only their latest reservation: for an older one, other
	// callers were already told to wait, and giving it back could let the
	// bucket overfill.
	Cancel(ctx context.Context, key string, r Reservation) error
	// Block counts nothing for key during d from now: calls are denied
	// with RetryAfter at least until then, reservations are made after it.
	// A longer block already in place stays. For an upstream that answered
	// "429 Too Many Requests, Retry-After: d".
	Block(ctx context.Context, key string, d time.Duration) error
	// Peek tells how many events key could admit now (a bucket's level, a
	// window's room) and how much longer it is blocked, counting nothing.
	Peek(ctx context.Context, key string) (Level, error)
}

// Level is the answer to Peek.
type Level struct {
	Remaining  int           // events that could be admitted now
	BlockedFor time.Duration // how much longer a Block holds; 0: none
}

// Reservation is the answer to ReserveN.
//
// For a leaky bucket of Limit 10 per second and Burst 1 that has just
// admitted an event: ReserveN(key, 1, time.Second) is OK with Delay 100ms,
// the next one is OK with Delay 200ms, and so on until the tenth, which
// would need 1s; the eleventh is not OK and its Delay, 1.1s, is the
// RetryAfter of the refusal.
type Reservation struct {
	OK    bool          // the events are counted at At; false: nothing was counted
	Delay time.Duration // OK: act after this long (0: now); not OK: the wait after which they would fit now
	At    time.Time     // OK: when the events are counted, on the limiter's clock (Cancel needs it)
	N     int           // the events reserved
	// Remaining is how many more events fit at At.
	Remaining int
	// ResetAfter is how long from now until the key is back to its initial
	// state, this reservation included.
	ResetAfter time.Duration
}

// AsReserver returns lim as a Reserver, if it is one.
func AsReserver(lim Limiter) (Reserver, bool) {
	r, ok := lim.(Reserver)
	return r, ok
}

func (c compiled) checkReserve(n int, maxWait time.Duration) error {
	if maxWait < 0 {
		return fmt.Errorf("%w: maxWait must be >= 0, got %v", ErrInvalidCost, maxWait)
	}
	return c.checkCost(n)
}

func (c compiled) checkReservation(r Reservation) error {
	if !r.OK {
		return fmt.Errorf("%w: Cancel of a reservation that is not OK: it counted nothing, so there is nothing to give back", ErrInvalidCost)
	}
	return c.checkCost(r.N)
}
