package throttle

import (
	"context"
	"fmt"
	"time"

	"github.com/sluicehq/sluice/algorithms"
)

// MaxSeries is the most turns one BookSeries books: one script run books
// them all, and holds its Redis server meanwhile.
const MaxSeries = algorithms.MaxSeries

// maxSeriesClaims bounds the claims of one BookSeries: each turn is
// searched on every claim.
const maxSeriesClaims = 8

// remindEach is what RemindEach asks.
type remindEach struct {
	key         string
	members     []string
	lead, after time.Duration
}

// RemindEach is Remind for BookSeries: each turn booked more than after
// away notes members[i] (the i-th of its ids' member: a task's own ID,
// say) in the sorted set key, scored lead before its turn, all turns in
// one ZADD of the series' script run. As with Remind, it is done only
// where that run can write key (on a single Redis server: whenever the
// limiters are on it; on a cluster: key in the claims' slot), and each
// Booking's Reminded says whether its turn was noted. members must have
// one member per id of the BookSeries.
func RemindEach(key string, members []string, lead, after time.Duration) BookOption {
	return func(b *booker) {
		b.reminds = &remindEach{key: key, members: members, lead: lead, after: after}
	}
}

// BookSeries books one turn for each of ids, one after another, on the
// same claims: what len(ids) calls of Book(ctx, claims, notBefore,
// maxWait, opts...), the i-th with every claim's ID ids[i], would book,
// in order, decision for decision (the same instants, Remaining and
// pieces, and the same state afterwards). The claims' own ID must be
// empty and their Replaces nil. Each booked turn is kept under its ID as
// Book keeps it (MaxLate applies): a later Book of the same claims with
// that ID gets it back (Kept), and Cancel of its Reservation gives it
// back. For a backlog of fresh tasks, booked at once.
//
// It stops at the first turn that Book would not give (beyond maxWait),
// or whose instant is less than minAhead after the limiters' now (its
// time has come: book it with Book as usual); nothing is counted for that
// turn and the ones after it. It returns the booked turns, in order: a
// prefix of ids, maybe empty. With minAhead 0 a turn at now may be
// booked: as Book's, it is counted but not kept under its ID.
//
// A limiter WithRecentThrottles counts, for the booked turns, the events
// those Books would have counted (each turn's n where the limiter alone
// would have given a later instant than the turn's start), all at the
// series' one instant. The turn it stops at is not counted, though its
// Book would count it, refused or not: the series did not book it, and
// the caller's Book of it counts it.
//
// Precondition: no turn is kept under any of ids (they were never
// booked): the series does not look, and a turn kept under one stays
// counted (under-use, never excess). Misuse (an empty or repeated id, more
// than MaxSeries ids or 8 claims, a negative wait, Remind in place of
// RemindEach, KeepAfter, RecentRefusalsOnly) is an error wrapping ErrMisuse.
//
// Claims in one Redis Cluster slot (all claims, on a single Redis server)
// of limiters of New are booked in one script run: one TIME, one read
// and one write of each claim's state, one SET per turn and claim of the
// kept turn, one ZADD for all reminders, and one GET and SET of each
// claim's recent throttles where any were counted. Otherwise (claims in
// several slots, or a limiter of NewFairShare or Replacing) the series is
// len(ids) Books with the same outcome, each in turn; a turn that comes
// sooner than minAhead is then booked and given back at once (and if
// RemindEach's after is below minAhead, its reminder may stay noted), and
// a recent throttle of the turn it stops at is counted by its Book there
// and again by the caller's Book of it. Local limiters (NewLocal) book the
// series in process, as those Books would, and count no recent throttles.
//
// When Redis fails, BookSeries returns the error (its limiters' failure
// policies are not applied) and no bookings: book the tasks one by one
// with Book then, whose policies apply. Turns the series may have booked
// (a reply lost on its way back) are kept under their IDs, so those Books
// get them back.
func BookSeries(ctx context.Context, claims []Claim, ids []string, notBefore time.Time, minAhead, maxWait time.Duration, opts ...BookOption) ([]Booking, error) {
	misuse := func(format string, args ...any) ([]Booking, error) {
		return nil, fmt.Errorf("%w: BookSeries: %s", ErrMisuse, fmt.Sprintf(format, args...))
	}
	switch {
	case maxWait < 0:
		return misuse("maxWait must be >= 0, got %v", maxWait)
	case minAhead < 0:
		return misuse("minAhead must be >= 0, got %v", minAhead)
	case len(ids) > MaxSeries:
		return misuse("at most %d ids a call, got %d: split them", MaxSeries, len(ids))
	case len(claims) == 0:
		return misuse("no claims to book on")
	case len(claims) > maxSeriesClaims:
		return misuse("at most %d claims, got %d", maxSeriesClaims, len(claims))
	}
	seen := make(map[string]int, len(ids))
	for i, id := range ids {
		if id == "" {
			return misuse("ids[%d] is empty: every turn is kept under its ID", i)
		}
		if j, ok := seen[id]; ok {
			return misuse("ids[%d] and ids[%d] are both %q: one ID names one turn", j, i, id)
		}
		seen[id] = i
	}
	for i, c := range claims {
		if c.ID != "" {
			return misuse("claim %d has ID %q: the series names each turn by its ids", i, c.ID)
		}
		if c.Replaces != nil {
			return misuse("claim %d replaces a turn: a series books fresh turns only", i)
		}
	}
	b, err := newBooker(claims, notBefore, maxWait, opts)
	if err != nil {
		return nil, err
	}
	if b.remind != nil {
		return misuse("Remind notes one member; a series notes one per turn with RemindEach")
	}
	if b.keepAfter > 0 {
		return misuse("KeepAfter is Book's: a series keeps every turn after now, for tasks that go away until their turns")
	}
	if b.refusalsOnly {
		return misuse("RecentRefusalsOnly is Book's: a series counts the throttles of the turns it books")
	}
	if r := b.reminds; r != nil && len(r.members) != len(ids) {
		return misuse("RemindEach has %d members for %d ids: want one per id", len(r.members), len(ids))
	}
	if len(ids) == 0 {
		return nil, nil
	}
	groups := groupsOf(b.parts)
	if len(groups) > 1 || !seriesRuns(b.parts) {
		return bookEach(ctx, claims, ids, notBefore, minAhead, maxWait, opts, b.reminds)
	}
	s := &step{op: algorithms.OpSeries, parts: b.parts, notBefore: b.notBefore, maxWait: b.maxWait, late: b.late, ids: ids, minAhead: minAhead.Microseconds()}
	if r := b.reminds; r != nil && groups[0].site.reaches(r.key) {
		s.reminds = &algorithms.RemindEach{Key: r.key, Members: r.members, Lead: r.lead.Microseconds(), After: max(0, r.after.Microseconds())}
	}
	if err := groups[0].site.run(ctx, s); err != nil {
		return nil, fmt.Errorf("throttle: BookSeries booked nothing (book the turns one by one): %w", err)
	}
	if len(s.series) == 0 {
		return nil, nil
	}
	booked := make([]Booking, len(s.series))
	for t, turn := range s.series {
		bk := Booking{OK: true, Reminded: turn.Reminded, At: time.UnixMicro(turn.At), Delay: micros(max(0, turn.At-turn.Now)), Turns: make([]Reservation, len(b.parts))}
		for i, p := range b.parts {
			c := turn.Claims[i]
			bk.Turns[i] = Reservation{
				OK: true, Delay: bk.Delay, At: bk.At, N: int(p.n),
				Remaining: int(c.Remaining), ResetAfter: micros(c.ResetAfter),
				ID: ids[t], kept: c.Keep, pieces: c.Pieces,
			}
		}
		booked[t] = bk
	}
	return booked, nil
}

// seriesRuns tells whether the series script (or its local twin) books a
// series of parts, all of one site: it knows the five limits' states and
// counts their recent throttles, not a fair share or a replaced limit.
func seriesRuns(parts []*part) bool {
	for _, p := range parts {
		if l, ok := p.lim.(*redisLimiter); ok && (l.fair != nil || l.replaces != nil) {
			return false
		}
	}
	return true
}

// bookEach is BookSeries as one Book per id, in turn: for claims the
// series script cannot book together. A turn sooner than minAhead is
// given back at once.
func bookEach(ctx context.Context, claims []Claim, ids []string, notBefore time.Time, minAhead, maxWait time.Duration, opts []BookOption, reminds *remindEach) ([]Booking, error) {
	claims = append([]Claim(nil), claims...)
	var booked []Booking
	for t, id := range ids {
		for i := range claims {
			claims[i].ID = id
		}
		turnOpts := opts
		if reminds != nil {
			turnOpts = append(append([]BookOption{}, opts...), func(b *booker) { b.reminds = nil },
				Remind(reminds.key, reminds.members[t], reminds.lead, reminds.after))
		}
		bk, err := Book(ctx, claims, notBefore, maxWait, turnOpts...)
		if err != nil {
			return nil, fmt.Errorf("throttle: BookSeries: the Book of ids[%d] (book the rest one by one): %w", t, err)
		}
		if !bk.OK {
			break
		}
		if bk.Delay < minAhead {
			for i, c := range claims {
				// A turn not given back stays counted: under-use, never excess.
				_ = c.Limiter.(Reserver).Cancel(context.WithoutCancel(ctx), c.Key, bk.Turns[i])
			}
			break
		}
		booked = append(booked, bk)
	}
	return booked, nil
}
