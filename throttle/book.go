package throttle

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/sluicehq/sluice/algorithms"
)

// Claim is n events on one key of one limiter: a part of a Book.
type Claim struct {
	Limiter Limiter // from New or NewLocal
	Key     string
	N       int
	// Replaces, if not nil, is an earlier turn of the same key that this
	// claim's turn takes the place of: it is given back in the same atomic
	// step, whatever the outcome (a turn that moves).
	Replaces *Reservation
	// ID, if not empty, names the turn. A turn booked in the future is kept
	// under its ID on the key until it has passed (by MaxLate); a later Book
	// whose claims all keep a turn under their IDs, at one instant not
	// passed by more than MaxLate, gets those turns back and counts
	// nothing (the caller is back for its turn, or calls again after a
	// reply was lost); kept turns that are not given back so are dropped
	// and the claims booked anew. Cancel of such a turn gives it back by ID,
	// once however often it is called. Any length: the key a turn is kept
	// under names the ID as Key names a key, hashed when long, so no two
	// IDs share one.
	ID string
}

// BookOption configures one Book.
type BookOption func(*booker)

// MaxLate sets how long after its instant a turn kept under its ID is still
// given back to its claim (default 0: until its instant); a claim back
// later books anew. For callers that act at their turn: a turn used long
// after its instant would count the event at another time than it happens.
func MaxLate(d time.Duration) BookOption {
	return func(b *booker) { b.late = max(0, d.Microseconds()) }
}

// RecentRefusalsOnly has a Book count its claims' events in their
// limiters' recent throttles (WithRecentThrottles) only if it is refused,
// not when it books a later turn than it asked for: for callers whose
// events were counted as throttled when they were given that later time
// to ask at (see NoteThrottled).
func RecentRefusalsOnly() BookOption {
	return func(b *booker) { b.refusalsOnly = true }
}

// KeepAfter has a Book keep its turn under the claims' IDs (see Claim.ID)
// only if the turn is more than d away (default 0: any turn after now).
// For callers that wait for a turn that near themselves, however they
// fare, and go away to come back for it only when it is further: a turn
// not kept costs no write of it, but a call again after a lost reply books
// another (the first is counted and not used), and Cancel gives it back by
// what it counted, as a turn without an ID.
func KeepAfter(d time.Duration) BookOption {
	return func(b *booker) { b.keepAfter = max(0, d.Microseconds()) }
}

// Remind has an OK Book whose turn is more than after away note it in the
// sorted set key, in the same script run as the booking: member, scored
// lead before the turn (µs on the limiters' clock). For callers that keep
// a schedule of who is due back when, without a second round trip (sluice
// notes there the tasks that go back to Redis to wait for their turns).
// It is done only where the booking is one script run on the server, and
// the cluster slot, that key is in (on a single Redis server: whenever the
// limiters are on it); Booking.Reminded says whether it was.
func Remind(key, member string, lead, after time.Duration) BookOption {
	return func(b *booker) {
		b.remind = &algorithms.Remind{Key: key, Member: member, Lead: lead.Microseconds(), After: max(0, after.Microseconds())}
	}
}

// Booking is the answer to Book.
//
// Booking a task on a queue's drain of 25/s (burst 1) that has just given
// a turn, and on an API's quota of 10/s that has 3 tokens left: OK, Delay
// 40ms (the drain's next turn), At now+40ms, and Turns[1].Remaining 2.
type Booking struct {
	// OK: every claim's events are counted at At. Not OK: none are.
	OK bool
	// Kept: the turns are those the claims kept under their IDs (see
	// Claim.ID), counted before; this Book counted nothing.
	Kept bool
	// Reminded: the turn was noted as Remind asked.
	Reminded bool
	// At is when the events are counted, on the limiters' clock.
	At time.Time
	// Delay is, when OK, how long from now until At; when not OK, how long
	// until the earliest instant found at which all of them might fit.
	Delay time.Duration
	// Turns has one Reservation per claim, in order. When OK, each claim's
	// turn (Reserver.Cancel gives it back). When not OK, each claim's own
	// answer: its Delay is the wait after which it alone would fit.
	Turns []Reservation
}

// Book counts every claim's events at one instant: the earliest, not
// before notBefore, at which all of them fit, if that is at most maxWait
// away (0: now or never). It counts all of them or none. Each limit sees
// the events at the instant they happen, so no limit's capacity is lost to
// another's wait and none is exceeded.
//
// Claims whose keys share a Redis Cluster slot (all claims, on a single
// Redis server) are booked in one atomic script run: one round trip. Claims
// in several slots are booked by a protocol that is exact too: slot by
// slot, in the order of the claims, each books its claims at its earliest
// instant not before the latest turn the slots before it hold; then slots
// whose turn is earlier than the latest give theirs back and book at that
// instant exactly, in the same script run; a slot that cannot moves the
// instant on. One round trip per slot when the later slots fit at the first
// slot's instant (put the claim likeliest to wait first: a queue's drain
// before an API's quota), one more when they do not; meanwhile a slot holds
// a turn it may give back (the window in which a concurrent caller can see
// it counted).
//
// A claim whose Redis fails is decided by its limiter's failure policy
// (WithOnRedisError): deny fails the Book with an error that wraps
// ErrRedisDenied; allow lets the claim through uncounted; local books it on
// an in-process twin of its limit.
func Book(ctx context.Context, claims []Claim, notBefore time.Time, maxWait time.Duration, opts ...BookOption) (Booking, error) {
	if maxWait < 0 {
		return Booking{}, fmt.Errorf("%w: maxWait must be >= 0, got %v", ErrMisuse, maxWait)
	}
	b, err := newBooker(claims, notBefore, maxWait, opts)
	if err != nil {
		return Booking{}, err
	}
	if b.reminds != nil {
		return Booking{}, fmt.Errorf("%w: RemindEach is an option of BookSeries; a Book notes its turn with Remind", ErrMisuse)
	}
	return b.book(ctx)
}

// book is Book at exactly ahead after the limiters' now (on their clock,
// which this process need not share): for a Pool's leases.
func book(ctx context.Context, claims []Claim, ahead time.Duration) (Booking, error) {
	parts, err := partsOf(claims)
	if err != nil {
		return Booking{}, err
	}
	b := &booker{parts: parts, ahead: ahead.Microseconds(), maxWait: ahead.Microseconds()}
	return b.book(ctx)
}

// ErrRedisDenied is wrapped by the error of a call that Redis could not
// decide, on a limiter whose failure policy is deny.
var ErrRedisDenied = errors.New("throttle: redis failed and the limit's policy is deny")

// limiter is what Book needs of a Limiter from New or NewLocal.
type limiter interface {
	Reserver
	compiled() compiled
	// site is where key's claims are decided: claims of one site are
	// decided together, in one atomic step.
	site(key string) site
	// policy is what to do when its site fails, and the local twin.
	policy() (string, limiter)
	// now is the time on the limiter's clock as this process knows it.
	now() time.Time
}

// site decides the claims of one step atomically.
type site interface {
	run(ctx context.Context, s *step) error
	// reaches reports whether a step's script run can write key too.
	reaches(key string) bool
}

// part is one claim on the limiter that decides it.
type part struct {
	claim    int // its index in the Book
	lim      limiter
	key      string
	n        int64
	fallback string // the failure policy that decides it, or ""
	replaces string // the pieces of the turn it replaces, or ""
	id       string // its turn's ID, or ""
}

// step is one operation on the parts of one site, and once run, its
// outcome.
type step struct {
	op        string // algorithms.OpBook, OpCancel, OpBlock or OpPeek
	parts     []*part
	notBefore int64              // book: µs; block: the block's length
	ahead     int64              // book: > 0: not before now + ahead µs on the site's clock instead
	maxWait   int64              // book
	exact     bool               // book
	late      int64              // book: see MaxLate
	keepAfter int64              // book: see KeepAfter
	refusals  bool               // book: see RecentRefusalsOnly
	giveBack  []string           // per part, or nil
	remind    *algorithms.Remind // book: see Remind
	out       algorithms.Booking
	// series: a turn for each of ids (see BookSeries), none sooner than
	// minAhead µs; series is the turns booked.
	ids      []string
	minAhead int64
	reminds  *algorithms.RemindEach
	series   []algorithms.Booking
}

func partsOf(claims []Claim) ([]*part, error) {
	parts := make([]*part, len(claims))
	for i, c := range claims {
		lim, ok := c.Limiter.(limiter)
		if !ok {
			return nil, fmt.Errorf("throttle: Book: claim %d: limiter %T is not one of New or NewLocal", i, c.Limiter)
		}
		if err := lim.compiled().checkCost(c.N); err != nil {
			if len(claims) > 1 {
				err = fmt.Errorf("claim %d: %w", i, err)
			}
			return nil, err
		}
		for _, p := range parts[:i] {
			if p.lim == lim && p.key == c.Key {
				return nil, fmt.Errorf("%w: claims %d and %d are on the same key %q of one limiter: make them one claim", ErrMisuse, p.claim, i, c.Key)
			}
		}
		parts[i] = &part{claim: i, lim: lim, key: c.Key, n: int64(c.N), id: c.ID}
		if r := c.Replaces; r != nil && r.OK && r.Fallback == "" {
			parts[i].replaces = lim.compiled().piecesOf(*r)
		}
	}
	return parts, nil
}

// group is the parts of one site, and the turn they hold.
type group struct {
	site    site
	parts   []*part
	allowed []*part // let through by the allow policy: nothing to book
	held    bool    // the parts are counted at at
	at      int64
	pieces  []string
	out     algorithms.Booking // the last step's outcome
}

func groupsOf(parts []*part) []*group {
	if len(parts) == 1 {
		return []*group{{site: parts[0].lim.site(parts[0].key), parts: parts}}
	}
	var groups []*group
	bySite := map[site]*group{}
	for _, p := range parts {
		s := p.lim.site(p.key)
		g := bySite[s]
		if g == nil {
			g = &group{site: s}
			bySite[s] = g
			groups = append(groups, g)
		}
		g.parts = append(g.parts, p)
	}
	return groups
}

// run runs s on g's site. When the site fails, each part's failure policy
// decides it: a deny fails the step; allow takes the part out of the step;
// local moves it to its limiter's local twin, where s runs again.
func (g *group) run(ctx context.Context, s *step) error {
	s.parts = g.parts
	return g.recover(ctx, s, g.site.run(ctx, s))
}

// recover is run's answer to err, its site's failure (nil: none): each
// part's failure policy.
func (g *group) recover(ctx context.Context, s *step, err error) error {
	if err == nil || ctx.Err() != nil || errors.Is(err, ErrInvalidCost) || errors.Is(err, ErrMisuse) {
		return err
	}
	var twins []*part
	for _, p := range g.parts {
		policy, twin := p.lim.policy()
		switch policy {
		case OnRedisErrorAllow:
			p.fallback = OnRedisErrorAllow
			g.allowed = append(g.allowed, p)
		case OnRedisErrorLocal:
			twins = append(twins, &part{claim: p.claim, lim: twin, key: p.key, n: p.n, fallback: OnRedisErrorLocal, id: p.id})
		default:
			return fmt.Errorf("%w: %w", ErrRedisDenied, err)
		}
	}
	g.parts, g.site = twins, localSite{}
	if s.giveBack != nil {
		// What the twins give back was counted on Redis, if anywhere.
		s.giveBack = make([]string, len(twins))
	}
	s.parts = twins
	if len(twins) == 0 {
		return nil
	}
	return g.site.run(ctx, s)
}

// newBooker is a Book's or a BookSeries's booker for claims: their parts,
// and the longest wait no longer than any limit's horizon.
func newBooker(claims []Claim, notBefore time.Time, maxWait time.Duration, opts []BookOption) (*booker, error) {
	parts, err := partsOf(claims)
	if err != nil {
		return nil, err
	}
	wait := maxWait.Microseconds()
	for _, p := range parts {
		wait = min(wait, p.lim.compiled().horizon)
	}
	b := &booker{parts: parts, notBefore: unixMicros(notBefore), maxWait: wait}
	for _, opt := range opts {
		opt(b)
	}
	return b, nil
}

// booker runs one Book.
type booker struct {
	parts     []*part
	notBefore int64
	ahead     int64 // > 0: not before the limiters' now + ahead µs, instead of notBefore
	maxWait   int64
	late      int64
	keepAfter int64 // see KeepAfter
	// refusalsOnly: see RecentRefusalsOnly.
	refusalsOnly bool
	remind       *algorithms.Remind // see Remind
	reminds      *remindEach        // see RemindEach: BookSeries only
	moving       time.Time          // when the latest round that moved turns began
}

// maxRounds bounds the rounds in which slots that disagree move their
// turns to one instant; each round moves the instant on.
const maxRounds = 8

func (b *booker) book(ctx context.Context) (Booking, error) {
	groups := groupsOf(b.parts)
	first := func(g *group) *step {
		s := &step{op: algorithms.OpBook, notBefore: b.notBefore, ahead: b.ahead, maxWait: b.maxWait, late: b.late, keepAfter: b.keepAfter, refusals: b.refusalsOnly}
		for _, p := range g.parts {
			if p.replaces != "" {
				s.giveBack = make([]string, len(g.parts))
				for i, p := range g.parts {
					s.giveBack[i] = p.replaces
				}
				break
			}
		}
		if b.remind != nil && len(groups) == 1 && g.site.reaches(b.remind.Key) {
			s.remind = b.remind
		}
		return s
	}
	var err error
	if len(groups) > 1 {
		// Slot by slot, in the order of the claims (callers put the limit
		// likeliest to refuse first), each asked for its earliest turn at
		// or after the latest one held so far: no slot holds a turn before
		// the booking's instant (asked all at once, a quota held one "now"
		// for every task before moving it to the task's drain turn, and
		// such holds made other tasks' drains give their turns up to a
		// later instant, where no one could use them), and a refusal holds
		// nothing in the slots after it.
		err = b.inTurn(ctx, groups, first)
	} else {
		err = b.each(ctx, groups, first)
	}
	if err != nil {
		return Booking{}, err
	}
	at, agreed := b.settle(groups)
	for round := 0; !agreed && round < maxRounds; round++ {
		var refused bool
		for _, g := range groups {
			refused = refused || (len(g.parts) > 0 && !g.held)
		}
		if refused && (b.maxWait == 0 || at-groups[0].out.Now > b.maxWait) {
			break
		}
		b.moving = time.Now()
		err := b.each(ctx, groups, func(g *group) *step {
			if g.held && b.together(g.at, at) {
				return nil
			}
			s := &step{op: algorithms.OpBook, notBefore: at, maxWait: b.maxWait, exact: true, late: b.late, keepAfter: b.keepAfter}
			if g.held {
				s.giveBack = g.pieces
			}
			return s
		})
		if err != nil {
			return Booking{}, err
		}
		at, agreed = b.settle(groups)
	}
	if !agreed {
		b.cancel(ctx, groups)
		return b.refusal(groups, at), nil
	}
	return b.success(groups, at), nil
}

// together reports whether a group's turn at at counts as the booking's
// turn at latest. Slots on different servers asked to book at one instant
// that has passed on their clocks book "now" instead, a moment apart:
// turns apart by no more than that round took are one turn. Turns booked
// before any slot was asked to move must be within skew of each other
// (each server's "now", asked at once).
func (b *booker) together(at, latest int64) bool {
	tolerance := skew
	if !b.moving.IsZero() {
		tolerance += time.Since(b.moving)
	}
	return latest-at <= tolerance.Microseconds()
}

// skew is how far apart two servers' "now" may be for turns booked at once
// to be one turn: Redis Cluster nodes read their own clocks.
const skew = time.Millisecond

// settle returns the latest instant any group offered, and whether every
// group holds a turn there.
func (b *booker) settle(groups []*group) (at int64, agreed bool) {
	agreed = true
	for _, g := range groups {
		if len(g.parts) > 0 {
			at = max(at, g.out.At)
		}
	}
	for _, g := range groups {
		agreed = agreed && (len(g.parts) == 0 || g.held && b.together(g.at, at))
	}
	return at, agreed
}

// inTurn runs the step stepOf gives each group, one group after another,
// each not before the latest turn the groups before it hold, until one
// refuses.
func (b *booker) inTurn(ctx context.Context, groups []*group, stepOf func(*group) *step) error {
	var latest int64
	for _, g := range groups {
		err := b.each(ctx, []*group{g}, func(g *group) *step {
			s := stepOf(g)
			if latest > 0 && s.notBefore < latest {
				s.notBefore, s.ahead = latest, 0
			}
			return s
		})
		if err != nil {
			b.cancel(ctx, groups)
			return err
		}
		if len(g.parts) > 0 && !g.held {
			return nil
		}
		if g.held {
			latest = max(latest, g.at)
		}
	}
	return nil
}

// each runs the step stepOf gives each group (nil: none), all groups at
// once. If a group fails, the turns the others hold are given back.
func (b *booker) each(ctx context.Context, groups []*group, stepOf func(*group) *step) error {
	if len(groups) == 1 { // the common case, without goroutines
		g := groups[0]
		if s := stepOf(g); s != nil && len(g.parts) > 0 {
			if err := g.take(ctx, s); err != nil {
				g.held = false
				return err
			}
		}
		return nil
	}
	errs := make([]error, len(groups))
	var wg sync.WaitGroup
	for i, g := range groups {
		s := stepOf(g)
		if s == nil || len(g.parts) == 0 { // all let through by the allow policy
			continue
		}
		wg.Go(func() { errs[i] = g.take(ctx, s) })
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		for i, g := range groups {
			if errs[i] != nil {
				g.held = false
			}
		}
		b.cancel(ctx, groups)
		return err
	}
	return nil
}

// take runs s on g and has g hold what it booked; what g held before was
// given back in the same step.
func (g *group) take(ctx context.Context, s *step) error {
	if err := g.run(ctx, s); err != nil {
		return err
	}
	g.out, g.held = s.out, s.out.OK
	if g.held {
		g.at, g.pieces = s.out.At, g.pieces[:0]
		for _, c := range s.out.Claims {
			g.pieces = append(g.pieces, c.Pieces)
		}
	}
	return nil
}

// cancel gives back every turn the groups hold, even if ctx has ended:
// else the turns stay counted.
func (b *booker) cancel(ctx context.Context, groups []*group) {
	ctx = context.WithoutCancel(ctx)
	var wg sync.WaitGroup
	for _, g := range groups {
		if !g.held || len(g.parts) == 0 {
			continue
		}
		wg.Go(func() {
			// A turn that cannot be given back stays counted: under-use, never excess.
			_ = g.site.run(ctx, &step{op: algorithms.OpCancel, parts: g.parts, giveBack: g.pieces})
			g.held = false
		})
	}
	wg.Wait()
}

func (b *booker) success(groups []*group, at int64) Booking {
	now := int64(0)
	for _, g := range groups {
		now = max(now, g.out.Now)
	}
	if now == 0 {
		// Every claim was let through by the allow policy: nothing was
		// decided, on any clock but the caller's.
		now = b.parts[0].lim.now().UnixMicro()
		at = max(now, b.notBefore)
	}
	bk := Booking{OK: true, At: time.UnixMicro(at), Delay: micros(max(0, at-now)), Turns: make([]Reservation, len(b.parts))}
	decided, kept := false, true
	for _, g := range groups {
		if len(g.parts) > 0 {
			decided, kept = true, kept && g.out.Kept
		}
	}
	bk.Kept = decided && kept
	bk.Reminded = len(groups) == 1 && groups[0].out.Reminded
	for _, g := range groups {
		for i, p := range g.parts {
			c := g.out.Claims[i]
			bk.Turns[p.claim] = Reservation{
				OK: true, Delay: bk.Delay, At: bk.At, N: int(p.n),
				Remaining: int(c.Remaining), ResetAfter: micros(c.ResetAfter),
				Fallback: p.fallback, ID: p.id, kept: p.id != "" && (at-g.out.Now > b.keepAfter || g.out.Kept), pieces: c.Pieces,
			}
		}
		for _, p := range g.allowed {
			bk.Turns[p.claim] = Reservation{OK: true, Delay: bk.Delay, At: bk.At, N: int(p.n), Fallback: p.fallback}
		}
	}
	return bk
}

func (b *booker) refusal(groups []*group, at int64) Booking {
	now := int64(0)
	for _, g := range groups {
		now = max(now, g.out.Now)
	}
	bk := Booking{At: time.UnixMicro(at), Delay: micros(max(0, at-now)), Turns: make([]Reservation, len(b.parts))}
	for _, g := range groups {
		for i, p := range g.parts {
			if len(g.out.Claims) == 0 { // not asked: an earlier slot refused
				bk.Turns[p.claim] = Reservation{N: int(p.n), Fallback: p.fallback}
				continue
			}
			c := g.out.Claims[i]
			bk.Turns[p.claim] = Reservation{
				Delay: micros(max(0, c.RetryAfter)), N: int(p.n),
				Remaining: int(c.Remaining), ResetAfter: micros(c.ResetAfter), Fallback: p.fallback,
			}
		}
		for _, p := range g.allowed {
			bk.Turns[p.claim] = Reservation{N: int(p.n), Fallback: p.fallback}
		}
	}
	return bk
}
