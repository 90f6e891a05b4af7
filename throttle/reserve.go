package throttle

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/sluicehq/sluice/algorithms"
)

// Reserver is a Limiter that can also book the earliest turn of events that
// do not fit now. The limiters New and NewLocal return implement it.
//
// A reservation is counted at once, at its turn: callers after it see it,
// so a queue of waiters gets one turn each instead of all coming back
// together. Turns may be booked in any order (a turn before others booked
// earlier, in a gap they left), and any turn can be given back exactly. A
// reservation that will not be used must be given back with Cancel, or its
// turn is lost to everyone.
type Reserver interface {
	Limiter
	// ReserveN counts n events for key now if they fit, or else at the
	// earliest instant they fit if that is at most maxWait away. A
	// reservation that is not OK counted nothing. ReserveN is shorthand
	// for ReserveAfter with the zero Time.
	ReserveN(ctx context.Context, key string, n int, maxWait time.Duration) (Reservation, error)
	// ReserveAfter is ReserveN with the events counted no earlier than
	// notBefore (on the limiter's clock). It is shorthand for Book with one
	// claim.
	ReserveAfter(ctx context.Context, key string, n int, notBefore time.Time, maxWait time.Duration) (Reservation, error)
	// Cancel gives back the events of an OK reservation for key, exactly:
	// later turns keep theirs, and the room it frees goes to whoever asks
	// next.
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
	// ResetAfter is how long until everything the key counted has passed
	// (its turns booked ahead included): a leaky bucket of 10/s, burst 1,
	// with turns booked for the next 5 events, would say 600ms.
	ResetAfter time.Duration
}

// Reservation is the answer to ReserveN, and one claim's part of a Booking.
//
// For a leaky bucket of Limit 10 per second and Burst 1 that has just
// admitted an event: ReserveN(key, 1, time.Second) is OK with Delay 100ms,
// the next one is OK with Delay 200ms, and so on until the tenth, which
// would need 1s; the eleventh is not OK and its Delay, 1.1s, is the
// RetryAfter of the refusal.
type Reservation struct {
	OK    bool          // the events are counted at At; false: nothing was counted
	Delay time.Duration // OK: act after this long (0: now); not OK: the wait after which they would fit now
	At    time.Time     // OK: when the events are counted, on the limiter's clock
	N     int           // the events reserved
	// Remaining is how many more events fit at At.
	Remaining int
	// ResetAfter is how long from now until the key is back to its initial
	// state, this reservation included.
	ResetAfter time.Duration
	// Fallback is the failure policy that decided the reservation because
	// Redis failed (OnRedisErrorAllow or OnRedisErrorLocal), or "".
	Fallback string
	// ID is the claim's ID (see Claim.ID), or "".
	ID string

	kept   bool   // the turn is kept under ID: Cancel gives it back by ID
	pieces string // what Cancel gives back otherwise
}

// piecesOf is what giving r back gives back: what its call returned, or
// for the windowed algorithms, whose turns are their instants, r.At.
func (c compiled) piecesOf(r Reservation) string {
	if r.pieces != "" || c.algorithm == algorithms.TokenBucket || c.algorithm == algorithms.LeakyBucket {
		return r.pieces
	}
	return strconv.FormatInt(r.At.UnixMicro(), 10)
}

// maxTurnText bounds the text of a Reservation (UnmarshalText): a turn in a
// task's headers comes from whoever enqueued the task.
const maxTurnText = 4096

// MarshalText encodes an OK reservation so that another process can use it
// or give it back (Cancel, Claim.Replaces): its instant, its events, the
// policy that made it and what giving it back gives back.
func (r Reservation) MarshalText() ([]byte, error) {
	if !r.OK {
		return nil, errors.New("throttle: a reservation that is not OK holds no turn to keep")
	}
	kept := 0
	if r.kept {
		kept = 1
	}
	// The ID goes last: it may hold anything, ';' included.
	text := fmt.Appendf(nil, "%d;%d;%s;%d;%s;%s", r.At.UnixMicro(), r.N, r.Fallback, kept, r.pieces, r.ID)
	if len(text) > maxTurnText {
		return nil, fmt.Errorf("throttle: a reservation's text would be %d bytes (its ID %d), more than UnmarshalText takes (%d)", len(text), len(r.ID), maxTurnText)
	}
	return text, nil
}

// UnmarshalText decodes what MarshalText wrote, checking every field: the
// text may have travelled through hands that are not trusted.
func (r *Reservation) UnmarshalText(text []byte) error {
	bad := func(why string) error { return fmt.Errorf("throttle: reservation text %.40q: %s", text, why) }
	if len(text) > maxTurnText {
		return bad(fmt.Sprintf("longer than %d bytes", maxTurnText))
	}
	fields := strings.SplitN(string(text), ";", 6)
	if len(fields) != 6 {
		return bad("want at;n;fallback;kept;pieces;id")
	}
	at, err := strconv.ParseInt(fields[0], 10, 64)
	if err != nil || at <= 0 || at >= algorithms.MaxExact {
		return bad("at must be µs since the epoch")
	}
	n, err := strconv.Atoi(fields[1])
	if err != nil || n <= 0 {
		return bad("n must be > 0")
	}
	switch fields[2] {
	case "", OnRedisErrorAllow, OnRedisErrorLocal:
	default:
		return bad("unknown fallback")
	}
	if fields[3] != "0" && fields[3] != "1" {
		return bad("kept must be 0 or 1")
	}
	for _, f := range strings.Fields(fields[4]) {
		if v, err := strconv.ParseInt(f, 10, 64); err != nil || v <= -algorithms.MaxExact || v >= algorithms.MaxExact {
			return bad("pieces must be integers below 2^53")
		}
	}
	*r = Reservation{OK: true, At: time.UnixMicro(at), N: n, Fallback: fields[2], kept: fields[3] == "1", pieces: fields[4], ID: fields[5]}
	return nil
}

// base implements the Reserver methods of both engines, each as one step
// on one key; self is the engine's limiter.
type base struct {
	spec compiled
	self limiter
}

func (b *base) compiled() compiled { return b.spec }

// AllowN implements Limiter.
func (b *base) AllowN(ctx context.Context, key string, n int) (Decision, error) {
	return decisionOf(b.ReserveAfter(ctx, key, n, time.Time{}, 0))
}

// decisionOf is AllowN's answer from its reservation r.
func decisionOf(r Reservation, err error) (Decision, error) {
	if err != nil {
		return Decision{}, err
	}
	d := Decision{Allowed: r.OK, Remaining: r.Remaining, ResetAfter: r.ResetAfter}
	if !r.OK {
		d.RetryAfter = r.Delay
	}
	return d, nil
}

// ReserveN implements Reserver.
func (b *base) ReserveN(ctx context.Context, key string, n int, maxWait time.Duration) (Reservation, error) {
	return b.ReserveAfter(ctx, key, n, time.Time{}, maxWait)
}

// ReserveAfter implements Reserver.
func (b *base) ReserveAfter(ctx context.Context, key string, n int, notBefore time.Time, maxWait time.Duration) (Reservation, error) {
	bk, err := Book(ctx, []Claim{{Limiter: b.self, Key: key, N: n}}, notBefore, maxWait)
	if err != nil {
		return Reservation{}, err
	}
	r := bk.Turns[0]
	if !r.OK {
		// One claim: its own wait is the booking's.
		r.Delay = max(r.Delay, bk.Delay)
	}
	return r, nil
}

// Cancel implements Reserver.
func (b *base) Cancel(ctx context.Context, key string, r Reservation) error {
	if !r.OK {
		return fmt.Errorf("%w: Cancel of a reservation that is not OK: it counted nothing, so there is nothing to give back", ErrMisuse)
	}
	if err := b.spec.checkCost(r.N); err != nil {
		return err
	}
	pieces := b.spec.piecesOf(r)
	if pieces == "" && !r.kept {
		return fmt.Errorf("%w: Cancel of a bucket's reservation needs the Reservation its call returned (or its text)", ErrMisuse)
	}
	lim := b.self
	switch r.Fallback {
	case OnRedisErrorAllow:
		return nil // counted nowhere
	case OnRedisErrorLocal:
		if _, lim = b.self.policy(); lim == nil {
			return nil // no twin here while the shares are not known: it counted nothing in this process
		}
	}
	g := &group{site: lim.site(key), parts: []*part{{lim: lim, key: key, n: int64(r.N)}}}
	s := &step{op: algorithms.OpCancel, giveBack: []string{pieces}}
	if r.kept {
		// By ID: given back once, however often Cancel is called.
		g.parts[0].id, s.giveBack = r.ID, []string{""}
	}
	return g.run(ctx, s)
}

// Block implements Reserver.
func (b *base) Block(ctx context.Context, key string, d time.Duration) error {
	if d <= 0 {
		return nil
	}
	return runOne(ctx, b.self, key, 1, &step{op: algorithms.OpBlock, notBefore: d.Microseconds()})
}

// Peek implements Reserver.
func (b *base) Peek(ctx context.Context, key string) (Level, error) {
	s := &step{op: algorithms.OpPeek}
	if err := runOne(ctx, b.self, key, 1, s); err != nil {
		return Level{}, err
	}
	if len(s.out.Claims) == 0 { // let through by the allow policy: nothing known
		return Level{}, nil
	}
	c := s.out.Claims[0]
	return Level{Remaining: int(c.Remaining), BlockedFor: micros(c.RetryAfter), ResetAfter: micros(c.ResetAfter)}, nil
}

// runOne runs s on key of lim, with lim's failure policy.
func runOne(ctx context.Context, lim limiter, key string, n int, s *step) error {
	g := &group{site: lim.site(key), parts: []*part{{lim: lim, key: key, n: int64(n)}}}
	return g.run(ctx, s)
}
