package throttle

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/sluicehq/sluice/algorithms"
)

// Pool hands out the events of a fixed set of claims from leases: batches
// of events counted on all of them at once, ahead, so that most callers act
// at once with no round trip to Redis. It is for limits far from their end;
// near it, Take says no and the caller books (Book) as usual.
//
// A lease of k events books them on every claim's bucket at one instant a
// little ahead. An event of the batch may then happen at any instant from
// the end of the lease's server time less the bucket's window (Burst ·
// Period / Limit) to its start: its server time still lies within the
// window after it, so the bucket's limit holds exactly, whenever within
// that span the events happen (see algorithms.BucketState). The events not
// taken when the span ends are given back, the last ones first. So a lease
// never lets a limit be exceeded; what it costs is room: while a lease is
// out, its untaken events are counted, and other callers may be told to
// wait for up to the lease's span (under-use, never excess).
//
// Only buckets (token_bucket, leaky_bucket) can lend events ahead, and only
// with room for a lease's span and events in their window: a burst of 1
// cannot (its events must be exactly Period/Limit apart). A pool needs room
// for 2 takes a lease: a lease of one would save no round trip.
type Pool struct {
	claims []Claim
	span   time.Duration // how long a lease's events may be taken
	most   int           // the largest lease, in takes
	// kept: unused takes up to this many stay counted when a lease ends (a
	// hundredth of the smallest burst): not worth a round trip.
	kept int

	// called, if set, after each script run the pool makes (a lease, a
	// give-back): what it costs Redis, for the caller's metrics.
	called func()
	clock  Clock // SystemClock unless injected (PoolClock)

	mu        sync.Mutex
	lease     *lease
	size      int       // takes in the next lease
	restUntil time.Time // no lease before then: the limits were near their end
}

// lease is one batch of events, and what is left of it.
type lease struct {
	booking   Booking
	k, taken  int
	from, to  time.Time // on our clock: when its events may be taken
	giveBack  func()    // stops the give-back at to, if not nil
	delivered bool      // given back already
}

// Lease sizes.
const (
	firstLease = 8
	maxLease   = 256
	// leaseRest is how long a pool books event by event after a lease
	// found its limits near their end.
	leaseRest = time.Second
)

// ErrNoLease is wrapped by NewPool's error for claims that cannot lend
// events ahead.
var ErrNoLease = errors.New("throttle: these limits cannot lend events ahead")

// PoolOption configures a Pool.
type PoolOption func(*Pool)

// OnScriptRun makes a Pool call f after each script run it makes on its
// limits' Redis (a lease, or giving back a lease's untaken events), so
// that what lending costs can be counted.
func OnScriptRun(f func()) PoolOption {
	return func(p *Pool) { p.called = f }
}

// PoolClock makes a Pool read time from c, and wait on it, instead of the
// system clock: for tests, with limiters that read c too (WithClock), so
// that the Pool and its limiters agree on what time it is.
func PoolClock(c Clock) PoolOption {
	return func(p *Pool) { p.clock = c }
}

// NewPool returns a Pool for claims. A lease's events may be taken for a
// span of up to each claim's bucket window (Burst · Period / Limit) less
// the server time of the largest lease (256 takes), or half the window
// where that leaves less, and at most maxSpan: the rest of the window is
// the room for the lease's events. It fails with ErrNoLease if a claim's
// limiter is not a bucket, or a bucket's window leaves room for fewer than
// 2 takes in a lease.
func NewPool(claims []Claim, opts ...PoolOption) (*Pool, error) {
	parts, err := partsOf(claims)
	if err != nil {
		return nil, err
	}
	span := maxSpan.Microseconds()
	for i, p := range parts {
		c := p.lim.compiled()
		if c.algorithm != algorithms.TokenBucket && c.algorithm != algorithms.LeakyBucket {
			return nil, fmt.Errorf("%w: claim %d is a %s, not a bucket", ErrNoLease, i, c.algorithm.Name)
		}
		// A roomy window (a keyed value's, whose few takes a second each
		// lease serves) lends for most of it, so that a lease serves more.
		window := c.params.Burst * c.params.Period / c.params.Limit
		fullLease := maxLease * p.n * c.params.Period / c.params.Limit
		span = min(span, max(window/2, window-fullLease))
	}
	if span < minSpan.Microseconds() {
		return nil, fmt.Errorf("%w: a bucket's window (Burst × Period / Limit) is below %v", ErrNoLease, 2*minSpan)
	}
	most := maxLease
	for _, p := range parts {
		c := p.lim.compiled()
		// k events of n each fit once the span has passed:
		// span + k·n·Period/Limit <= window.
		window := c.params.Burst * c.params.Period / c.params.Limit
		most = min(most, int((window-span)*c.params.Limit/c.params.Period/p.n))
	}
	// A lease of one take is a round trip per take, as a Book is, with
	// its event held a span ahead.
	if most < 2 {
		return nil, fmt.Errorf("%w: a lease holds %d takes, fewer than 2", ErrNoLease, max(most, 0))
	}
	kept := maxLease
	for _, p := range parts {
		kept = min(kept, int(p.lim.compiled().params.Burst/100/p.n))
	}
	p := &Pool{claims: claims, span: micros(span), most: most, kept: kept, size: min(firstLease, most), clock: SystemClock{}}
	for _, opt := range opts {
		opt(p)
	}
	return p, nil
}

// A lease's span: long enough that a lease serves many callers, short
// enough that what it holds unused is not held long.
const (
	maxSpan = time.Second
	minSpan = 5 * time.Millisecond
)

// Take takes one claim's worth of events from a lease (leasing more if the
// lease is spent), reporting true if the caller may act now. False means no
// lease could be had now (the limits are near their end, or a Book of them
// would wait); the caller books them itself. An error means Redis failed:
// the caller's Book applies the limits' failure policies.
func (p *Pool) Take(ctx context.Context) (bool, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	now := p.clock.Now()
	if l := p.lease; l != nil {
		if now.Before(l.from) {
			return false, nil // not open yet: book alone meanwhile
		}
		if l.taken < l.k && !now.After(l.to) {
			l.taken++
			return true, nil
		}
		p.sizeAfter(l, now)
		p.end(ctx, l)
	}
	if now.Before(p.restUntil) {
		return false, nil
	}
	l, err := p.book(ctx)
	if err != nil || l == nil {
		return false, err
	}
	p.lease = l
	l.taken = 1
	return true, nil
}

// book leases p.size takes, or returns nil (and rests) when the limits are
// near their end.
func (p *Pool) book(ctx context.Context) (*lease, error) {
	claims := make([]Claim, len(p.claims))
	for i, c := range p.claims {
		c.N *= p.size
		c.ID = ""
		claims[i] = c
	}
	// Booked span ahead of the limiters' now, exactly: events may then be
	// taken from now on (see the Pool doc). A limit that cannot give that
	// instant is busy: no lease.
	asked := p.clock.Now()
	bk, err := book(ctx, claims, p.span)
	answered := p.clock.Now()
	p.ran()
	if err != nil {
		return nil, err
	}
	if !bk.OK {
		p.rest(answered)
		return nil, nil
	}
	l := &lease{booking: bk, k: p.size, from: asked, to: answered.Add(p.span)}
	// The span each claim allows, on the limiters' clock, moved to ours
	// through the Book's own answer: the limiters' now was between asked
	// and answered, so from moves with answered and to with asked.
	for i, turn := range bk.Turns {
		lim := p.claims[i].Limiter.(limiter)
		from, to, ok := algorithms.LeaseWindow(lim.compiled().params, turn.pieces)
		if !ok || turn.Fallback != "" {
			p.end(ctx, l)
			p.rest(answered)
			return nil, nil
		}
		sinceNow := func(x int64) time.Duration { return micros(x-turn.At.UnixMicro()) + bk.Delay }
		l.from = later(l.from, answered.Add(sinceNow(from)))
		l.to = earlier(l.to, asked.Add(sinceNow(to)))
		// A lease that leaves less room than itself behind is taken from
		// limits near their end: the next callers book one by one.
		if turn.Remaining < p.size {
			p.restUntil = answered.Add(leaseRest)
		}
	}
	if !l.from.Before(l.to) {
		p.end(ctx, l)
		p.rest(answered)
		return nil, nil
	}
	l.giveBack = p.after(l.to.Sub(p.clock.Now()), func() {
		p.mu.Lock()
		defer p.mu.Unlock()
		if p.lease == l {
			p.sizeAfter(l, p.clock.Now())
		}
		p.end(context.Background(), l)
	})
	return l, nil
}

// after calls f once d has passed on the pool's clock, unless the
// function it returns is called first. On the system clock it is a timer;
// an injected clock has none, so a goroutine waits on it.
func (p *Pool) after(d time.Duration, f func()) (stop func()) {
	if _, system := p.clock.(SystemClock); system {
		t := time.AfterFunc(d, f)
		return func() { t.Stop() }
	}
	stopped := make(chan struct{})
	go func() {
		select {
		case <-p.clock.After(d):
			f()
		case <-stopped:
		}
	}()
	return func() { close(stopped) }
}

// sizeAfter sizes the next lease to what l served: twice as large when it
// was spent before its span ended.
func (p *Pool) sizeAfter(l *lease, now time.Time) {
	if l.taken == l.k && now.Before(l.to) {
		p.size = min(2*p.size, p.most)
	} else {
		p.size = max(1, min(l.taken+l.taken/4, p.most))
	}
}

// rest makes the pool book event by event for a while, with smaller
// leases after.
func (p *Pool) rest(now time.Time) {
	p.restUntil = now.Add(leaseRest)
	p.size = max(1, p.size/2)
}

// end gives back what l did not hand out, once.
func (p *Pool) end(ctx context.Context, l *lease) {
	if p.lease == l {
		p.lease = nil
	}
	if l.delivered {
		return
	}
	l.delivered = true
	if l.giveBack != nil {
		l.giveBack()
	}
	// A few events are not worth a round trip: they stay counted, under-use
	// of at most a tenth of a lease or a hundredth of a bucket's burst.
	unused := l.k - l.taken
	if unused <= max(l.k/10, p.kept) {
		return
	}
	ctx = context.WithoutCancel(ctx)
	for i, c := range p.claims {
		lim := c.Limiter.(limiter)
		turn := l.booking.Turns[i]
		tail := algorithms.TailPieces(lim.compiled().params, turn.pieces, int64(unused*c.N))
		g := &group{site: lim.site(c.Key), parts: []*part{{lim: lim, key: c.Key, n: int64(unused * c.N)}}}
		// A tail that cannot be given back stays counted: under-use.
		_ = g.run(ctx, &step{op: algorithms.OpCancel, giveBack: []string{tail}})
		p.ran()
	}
}

// ran tells the pool's owner of a script run.
func (p *Pool) ran() {
	if p.called != nil {
		p.called()
	}
}

// Left estimates, per claim, how many more takes its limit admits now: the
// current lease's untaken ones and the room its booking left. Other callers
// take from the same room meanwhile: it is a hint (for RateLimit headers),
// not a promise; nil without a lease.
func (p *Pool) Left() []int {
	p.mu.Lock()
	defer p.mu.Unlock()
	l := p.lease
	if l == nil {
		return nil
	}
	left := make([]int, len(l.booking.Turns))
	for i, turn := range l.booking.Turns {
		left[i] = turn.Remaining + (l.k-l.taken)*p.claims[i].N
	}
	return left
}

// Close gives back what the current lease did not hand out.
func (p *Pool) Close() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.lease != nil {
		p.end(context.Background(), p.lease)
	}
}

func later(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}

func earlier(a, b time.Time) time.Time {
	if b.Before(a) {
		return b
	}
	return a
}
