package jobs

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"log/slog"
	"slices"
	"sync"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/throttle"
)

// lateTolerance is how long after its instant a kept turn may still be
// used: none. A task back for its turn after it (the queue was paused, the
// fleet down or too busy) books again. A turn used late comes right before
// the next one, used on time: on a drain of 1,000/s, turns used 40ms late
// put 1,040 requests into a second. Tasks come back requeueLead before
// their turn, so only those delayed that long book again; and a task back
// late is taken before the queue's backlog (see ready), so it is rare.
const lateTolerance = 0

// booker books tasks' turns on their gates, the first step of a task's
// path (book). It needs the limits' Redis, and nothing of asynq's but the
// task. A Scheduler has one; tests build one alone (newBooker).
type booker struct {
	rdb     redis.UniversalClient
	metrics *Metrics
	log     *slog.Logger
	clock   schedClock
	lines   lineViews // the backlog lines' tails, as last read (backlog.go)
	// handsOver: the parker parks (the limits and the queues are on one
	// server), and a fresh task may be handed to it (toParker).
	handsOver bool
	holding   sync.Map // queue -> *atomic.Int64: tasks waiting in this worker (see hold)
	// logGate: a Redis failure is logged once every 10 seconds per queue.
	logGate throttle.Limiter
	// keyLogGate: a failed key expression is logged once a minute per limit.
	keyLogGate throttle.Limiter
}

func newBooker(rdb redis.UniversalClient, m *Metrics, log *slog.Logger, clock schedClock) *booker {
	b := &booker{rdb: rdb, metrics: m, log: log, clock: clock}
	b.logGate, _ = throttle.NewLocal(throttle.Spec{Algorithm: throttle.SlidingLog, Limit: 1, Period: 10 * time.Second})
	b.keyLogGate, _ = throttle.NewLocal(throttle.Spec{Algorithm: throttle.SlidingLog, Limit: 1, Period: time.Minute})
	return b
}

// bookedTurns are a task's turns on its rate gates: one per claim, given
// back if the task will not use them (Scheduler.giveBack).
type bookedTurns struct {
	claims []claim
	turns  []throttle.Reservation
}

// outcome is what a task's gates decided, one of: runNow, turnAhead,
// notedIn, askAgainIn, waitInLine, toParker. process is a switch over it.
type outcome interface{ outcome() }

// runNow: the task's turns have come (lent, booked for now, or it has no
// rate gates).
type runNow struct{ turns bookedTurns }

// turnAhead: the task's turns come at ready, on our clock (at on the
// limiters'): it waits for them in the worker, or in Redis (hold).
type turnAhead struct {
	turns bookedTurns
	ready time.Time
	at    time.Time
}

// notedIn: the task goes back to Redis, already noted in the wake set by
// its booking, due back in d: for a turn too far to wait for in the worker
// (its turns stay kept under its booking ID), or for its ticket in a
// backlog line.
type notedIn struct {
	d time.Duration
	// line: the backlog line it took a ticket in, if it did (the parker
	// gives the tasks queued behind it tickets in the same line at once).
	line *backlogLine
}

// askAgainIn: the task has no turn; it waits in Redis and asks its gates
// again in d: none within worker.reserve_max, Redis could not decide, or
// its key failed on a limit whose on_key_error is wait.
type askAgainIn struct{ d time.Duration }

// waitInLine: the task's key holds its fair share of the drain already;
// the task waits in its key's line until the queue's waker lets it out.
type waitInLine struct{ spot *lineSpot }

// toParker: the task, fresh, draws on a quota other queues may share, and
// its turn is further than handOverWithin: it books nothing and goes back
// to Redis unbooked, handed to the parker, which books it with the rest of
// its queue's backlog, the queues in turn by priority (park.go). Booked
// here, in the order the fleet's slots happen to take tasks (asynq picks a
// queue at random for each), a first take of tens of tasks would book
// seconds of the quota out of that turn, and a queue held back by its own
// drain would find the quota's turns after its drain's taken by the
// others: in TestPlanSharedQuota a queue ended up to 10% later than its
// plan, which takes the queues in turn.
type toParker struct{}

// handOverWithin is the furthest turn a worker books a fresh task of a
// shared quota (toParker): what the fleet's first take books out of the
// queues' turn, at most.
const handOverWithin = 250 * time.Millisecond

func (runNow) outcome()     {}
func (turnAhead) outcome()  {}
func (notedIn) outcome()    {}
func (askAgainIn) outcome() {}
func (waitInLine) outcome() {}
func (toParker) outcome()   {}

// taskRef is what a task's path reads of the task, once, as it starts.
type taskRef struct {
	t       *asynq.Task
	queue   string
	id      string
	booking string // bookingID: its turns' name in the limiters
	// fresh: it comes from its producer, not back from waiting in Redis
	// (where it may hold turns under its booking ID).
	fresh bool
	// exhausted: it has no retry left; asynq would archive it on the
	// retry path.
	exhausted bool
	// parked: the parker books it (park.go), not a worker: it is lent no
	// turn, which could not be given back if it has come.
	parked bool
	// handed: a worker handed it to the parker (toParker), after a booking
	// refused that counted it throttled: its booking by the parker counts
	// it again only if refused.
	handed bool
	// notBefore: its turns come no earlier (on the limiters' clock; zero:
	// now). A task the parker books that keeps a turn come already books
	// it requeueLead ahead, as every task in Redis is due back that long
	// before its turn (park.go's book).
	notBefore time.Time
}

// refOf reads task t, id in queue, as its path needs it; the rest comes
// from ctx (asynq's handler context).
func refOf(ctx context.Context, queue, id string, t *asynq.Task) taskRef {
	retried, _ := asynq.GetRetryCount(ctx)
	maxRetry, _ := asynq.GetMaxRetry(ctx)
	return taskRef{t: t, queue: queue, id: id, booking: bookingID(queue, id, t),
		fresh: retried == 0 && t.Headers()[headerOrigin] == "", exhausted: retried >= maxRetry}
}

// bookingID names a task's turns in the limiters: the same for the task
// and for the copies it may go back to Redis as, so that a task back for
// its turns gets them (throttle.Claim.ID). It is <queue>/<id>, or past
// maxBookingID bytes "#" and its SHA-256: no '/', so no other task's.
func bookingID(queue, id string, t *asynq.Task) string {
	if origin := t.Headers()[headerOrigin]; origin != "" {
		id = origin
	}
	bid := queue + "/" + id
	if len(bid) > maxBookingID {
		sum := sha256.Sum256([]byte(bid))
		return "#" + hex.EncodeToString(sum[:])
	}
	return bid
}

// maxBookingID bounds a booking ID: it goes with every script call of the
// task and into its key's line in a fair queue, and asynq takes ids of
// any length.
const maxBookingID = 1024

// book gives the task one turn on all its rate gates at once: the earliest
// instant at which every one of them admits it (throttle.Book). A task back
// for turns it booked before gets them under its booking ID, counting
// nothing; back too late for them, or after a gate changed, it books anew
// and what it held is given back, in the same step. In a queue with
// fairness the turn is booked on the queue's fair share too, and a task
// whose key holds its share already waits in its key's line instead. Most
// tasks of gates far from their limits are lent a turn instead (lent).
// What the gates decided is the outcome; letOut: the task was let out of
// its key's line, and books whatever this worker saw of its key.
func (b *booker) book(ctx context.Context, gs *gateSet, task taskRef, letOut bool) (outcome, error) {
	r := gs.routeOf(task.queue, task.t.Type())
	if len(r.gates) == 0 {
		return runNow{}, nil
	}
	claims := r.claims
	var vars *taskVars
	if r.keyed || r.fair {
		vars = varsOf(task.queue, task.id, task.t)
	}
	if r.keyed {
		var ok bool
		if claims, ok = b.claimsOf(r, vars); !ok {
			return askAgainIn{keyErrorWait}, nil // on_key_error: wait
		}
	}
	backlogs := gs.fair[task.queue] == nil // fair queues have lines of their own
	var line backlogLine
	var lineAhead bool
	if backlogs && task.fresh {
		line, lineAhead = b.activeLine(ctx, task.queue, claims, r.cost)
	}
	// A gate with a backlog line ahead binds: it lends nothing, which
	// would be a turn the line's tasks are due to take (and a lease tried
	// once a second, its turn given back unused: a gap in the gate's
	// future that every booking then reads round).
	if !lineAhead && b.lent(ctx, gs, task, r, claims) {
		return runNow{}, nil
	}
	return b.bookTurn(ctx, gs, task, letOut, r, claims, vars, line, lineAhead)
}

// bookTurn books the task's turn on claims (and its queue's fair share):
// book, for a task that was not lent one. lineAhead: line, the longest of
// the task's gates' backlog lines, reaches further than a worker holds a
// task for (activeLine; a fair queue has none).
func (b *booker) bookTurn(ctx context.Context, gs *gateSet, task taskRef, letOut bool, r *route, claims []claim, vars *taskVars, line backlogLine, lineAhead bool) (outcome, error) {
	queue, cost := task.queue, r.cost
	backlogs := gs.fair[queue] == nil // fair queues have lines of their own
	reserveMax := gs.cfg.Worker.ReserveMax
	if r.adaptive {
		reserveMax = min(reserveMax, adaptiveReserve)
	}
	// A fresh task whose quota other queues may share books only a turn
	// within handOverWithin; a further one is the parker's (toParker).
	handOver := b.handsOver && task.fresh && !task.parked && backlogs && !lineAhead &&
		len(r.quotas) > 0 && len(gs.cfg.Queues) > 1
	if handOver {
		reserveMax = min(reserveMax, handOverWithin)
	}
	var opts []throttle.BookOption
	if lineAhead {
		// A task back for its ticket (it looks fresh: waiting is no
		// failure) books its turn, which the waker brought it back for
		// in time to wait for here. It was counted throttled as it took
		// its ticket (a refused booking, or the parker's run of tickets:
		// ticketRun), and its turn is a little later than it asks for
		// (it comes back requeueLead early): counted again only if
		// refused.
		reserveMax = b.holdsUpTo(ctx, gs, task)
	}
	if lineAhead || task.handed {
		opts = append(opts, throttle.RecentRefusalsOnly())
	}
	var spot *lineSpot
	if f := gs.fair[queue]; f != nil {
		spot = &lineSpot{fair: f, key: b.keyOf(f.name, f.expr, vars), booking: task.booking, cost: cost}
		if !letOut && task.fresh && f.parkedView(spot.key, b.clock.Now()) {
			b.metrics.decisions.WithLabelValues(f.name, "parked").Inc()
			spot.seen = true
			return waitInLine{spot}, nil
		}
		// The fair share's claim comes right after the drain's: the script
		// tells it where the drain before it and the key's own quotas after
		// it put the turn (lua/book.lua), and one run books it with the
		// drain (both live under the queue's hash tag). Its turn is given
		// back with theirs.
		claims = slices.Concat(claims[:1], []claim{{g: f.share, lim: f.lim, key: spot.key}}, claims[1:])
	}
	bookClaims := make([]throttle.Claim, len(claims))
	for i, c := range claims {
		bookClaims[i] = throttle.Claim{Limiter: c.lim, Key: c.key, N: cost, ID: task.booking}
	}
	b.metrics.bookings.WithLabelValues(queue).Inc()
	start := time.Now()
	// A turn within alwaysHold is waited for here, whatever the room: it
	// is kept under the task's booking ID only if further (a SET less for
	// most bookings of a busy queue; a reply lost costs a turn).
	opts = append(opts, throttle.MaxLate(lateTolerance))
	if !task.parked { // the parker's tasks wait in Redis, whatever their turns
		opts = append(opts, throttle.KeepAfter(alwaysHold))
	}
	if !task.exhausted {
		// A turn too far to wait for here is noted in the wake set by the
		// booking itself: the task goes back to Redis for it without
		// another script run. (One with no retry left goes back as a copy,
		// noted under the copy's id.)
		opts = append(opts, throttle.Remind(wakeKeys(queue)[0], task.id, requeueLead, b.holdsUpTo(ctx, gs, task)))
	}
	bk, err := throttle.Book(ctx, bookClaims, task.notBefore, reserveMax, opts...)
	elapsed := time.Since(start).Seconds()
	// The gates' own claims are counted; the fair share's goes with the
	// drain'b.
	gates := slices.DeleteFunc(slices.Clone(claims), func(c claim) bool { return c.g.fair })
	for _, c := range gates {
		b.metrics.evaluations.WithLabelValues(c.g.name).Inc()
		b.metrics.scriptSeconds.WithLabelValues(c.g.name).Observe(elapsed)
	}
	if errors.Is(err, throttle.ErrRedisDenied) {
		// The task waits in Redis, not in a slot, and asks again soon.
		for _, c := range gates {
			b.metrics.redisErrors.WithLabelValues(c.g.name).Inc()
			if c.g.limit.OnRedisError == OnRedisErrorDeny {
				b.metrics.fallbacks.WithLabelValues(c.g.name, OnRedisErrorDeny).Inc()
			}
		}
		b.logRedisError(queue, err)
		return askAgainIn{redisRetry}, nil
	}
	if err != nil {
		return nil, err
	}
	for i, c := range claims {
		if c.g.fair && !bk.OK && bk.Turns[i].Delay > 0 {
			// The key holds its share of the drain already.
			spot.fair.refused(spot.key, b.clock.Now())
			b.metrics.decisions.WithLabelValues(c.g.name, "parked").Inc()
			return waitInLine{spot}, nil
		}
	}
	for i, c := range claims {
		// The fair share's claim is let through when Redis fails: the
		// drain's own policy is what counts.
		if fb := bk.Turns[i].Fallback; fb != "" && c.g.limit.Limit > 0 {
			b.metrics.redisErrors.WithLabelValues(c.g.name).Inc()
			b.metrics.fallbacks.WithLabelValues(c.g.name, fb).Inc()
		}
	}
	if !bk.OK {
		// The gate that needs the longest wait is the one that deferred.
		refused := 0
		for i, turn := range bk.Turns {
			if turn.Delay > bk.Turns[refused].Delay {
				refused = i
			}
		}
		if handOver {
			b.metrics.decisions.WithLabelValues(claims[refused].g.name, "deferred").Inc()
			return toParker{}, nil
		}
		if backlogs {
			if o, ok := b.deferToLine(ctx, task, line, lineAhead, claims[refused], cost, bk); ok {
				return o, nil
			}
		}
		b.metrics.decisions.WithLabelValues(claims[refused].g.name, "deferred").Inc()
		return askAgainIn{max(bk.Delay-gs.cfg.Worker.ReserveMax, 0) + time.Second}, nil
	}
	result := "now"
	switch {
	case bk.Kept:
		result = "held"
	case bk.Delay > 0:
		result = "reserved"
	}
	for i, c := range claims {
		b.metrics.decisions.WithLabelValues(c.g.name, result).Inc()
		if !bk.Kept && c.g.expr == nil && c.g.limit.Limit > 0 {
			b.metrics.remaining.WithLabelValues(c.g.name).Set(float64(bk.Turns[i].Remaining))
		}
	}
	if !bk.Kept {
		b.metrics.turnWait.WithLabelValues(queue).Observe(max(bk.Delay, 0).Seconds())
	}
	b.log.Debug("booked", "queue", queue, "at", bk.At.UnixMicro(), "delay", bk.Delay, "kept", bk.Kept)
	turns := bookedTurns{claims: claims, turns: bk.Turns}
	switch {
	case bk.Reminded:
		// Its turns stay kept under its booking ID: back for them just
		// before they come, it gets them.
		return notedIn{d: bk.Delay - requeueLead}, nil
	case bk.Delay <= 0:
		return runNow{turns}, nil
	}
	// The wait is the script's own, from when its answer came: no clock but
	// Redis's is involved (the answer's way back makes it a little late,
	// never early).
	return turnAhead{turns: turns, ready: b.clock.Now().Add(bk.Delay), at: bk.At}, nil
}

// claimsOf lists the claims a task on route r makes, in order: its
// queue's drain, then its type's quotas; a keyed gate's claim is on the
// task's key value. Not ok: a key failed on a limit whose on_key_error is
// wait, and the task waits.
func (b *booker) claimsOf(r *route, vars *taskVars) ([]claim, bool) {
	claims := make([]claim, len(r.gates))
	for i, g := range r.gates {
		c, ok := b.keyedClaim(g, vars, g.limit.OnKeyError == OnKeyErrorWait)
		if !ok {
			return nil, false
		}
		claims[i] = c
	}
	return claims, true
}

// claimOf is the task's claim on gate g: on its key value if g is
// keyed, with that value's own limit if it has one; DefaultKey if its key
// fails.
func (b *booker) claimOf(g *gate, vars *taskVars) claim {
	c, _ := b.keyedClaim(g, vars, false)
	return c
}

// keyedClaim is claimOf; with wait, a key that fails gives no claim (not
// ok) instead of DefaultKey's.
func (b *booker) keyedClaim(g *gate, vars *taskVars, wait bool) (claim, bool) {
	if g.expr == nil {
		return claim{g: g, lim: g.lim, key: g.key}, true
	}
	key, ok := b.evalKey(g.name, g.expr, vars, wait)
	if !ok {
		return claim{}, false
	}
	return g.claimOn(key), true
}

// claimOn is the claim on keyed gate g of a task whose key value is key:
// on the value as g keeps it, with its own limit if it has one (an
// override, or else the rate a keyed adaptive quota learned for it).
func (g *gate) claimOn(key string) claim {
	key = g.limit.storedKey(key)
	if ov := g.overrides.of(key, true); ov != nil {
		return claim{g: g, lim: ov.lim, key: key}
	}
	if lg := g.learned.of(key); lg != nil {
		lg.awaitTakeOver()
		return claim{g: lg, lim: lg.lim, key: key}
	}
	return claim{g: g, lim: g.lim, key: key}
}

// quietClaims is the claims a task makes on route r, for tools that read
// what it booked: a key that fails is DefaultKey's, uncounted and unlogged
// (the worker that books the task does both).
func quietClaims(r *route, vars *taskVars) []claim {
	if !r.keyed {
		return r.claims
	}
	claims := make([]claim, len(r.gates))
	for i, g := range r.gates {
		if g.expr == nil {
			claims[i] = claim{g: g, lim: g.lim, key: g.key}
			continue
		}
		key, err := g.expr.eval(vars)
		if err != nil {
			key = DefaultKey
		}
		claims[i] = g.claimOn(key)
	}
	return claims
}

// keyErrorWait is how long a task whose key failed on a limit with
// on_key_error: wait waits in Redis before it asks again: a fix comes by
// reload, and each ask costs a trip.
const keyErrorWait = 30 * time.Second

// keyOf is the task's key value for the limit named gate: what expr gives,
// or DefaultKey if it fails (counted, and logged at most once a minute per
// limit): a task is never failed for its key.
func (b *booker) keyOf(gate string, expr *keyExpr, vars *taskVars) string {
	key, _ := b.evalKey(gate, expr, vars, false)
	return key
}

// evalKey is keyOf; with wait, a key that fails is not ok (counted in
// sluice_key_waits_total, and logged at most once a minute per limit).
func (b *booker) evalKey(gate string, expr *keyExpr, vars *taskVars, wait bool) (string, bool) {
	key, err := expr.eval(vars)
	if err == nil {
		return key, true
	}
	logIt := func() bool { d, _ := b.keyLogGate.AllowN(context.Background(), gate, 1); return d.Allowed }
	if wait {
		b.metrics.keyWaits.WithLabelValues(gate).Inc()
		if logIt() {
			b.log.Error("a task's key expression failed; the task waits in Redis (on_key_error: wait) and asks again later: fix the expression (a reload is in force at once) or the task's payload (further failures of this limit in the next minute are only counted)",
				"gate", gate, "key", expr.source, "queue", vars.queue, "type", vars.typ, "id", vars.id, "err", err, "asks_again_in", keyErrorWait)
		}
		return "", false
	}
	b.metrics.keyFallbacks.WithLabelValues(gate).Inc()
	if logIt() {
		b.log.Warn("a task's key expression failed; the task takes the limit's default key (further failures of this limit in the next minute are only counted)",
			"gate", gate, "key", expr.source, "queue", vars.queue, "type", vars.typ, "id", vars.id, "err", err, "default", DefaultKey, "on_key_error", "default (set wait to hold such tasks instead)")
	}
	return DefaultKey, true
}

// lent reports whether a task that never booked before was lent a turn
// by its gates' pool (throttle.Pool): most tasks of gates far from their limits go
// without a round trip to Redis. A keyed gate's pool is its task's key
// value's: the values with tasks often enough to use a lease (see
// maxKeyedPools) lend as an unkeyed gate does. A task back from Redis
// books: it may hold turns under its booking ID. A pool that cannot lend
// now (its gates near their limits, or Redis failing) leaves the task to
// book. Queues with fairness book every task: a fair share is counted task
// by task (their routes have no pool, and keyed gates in them do not lend).
func (b *booker) lent(ctx context.Context, gs *gateSet, task taskRef, r *route, claims []claim) bool {
	if !task.fresh || task.parked {
		return false
	}
	pool := r.pool
	if r.keyed && !r.fair && !r.learns {
		pool = gs.poolOf(claims, r.cost)
	}
	if pool == nil {
		return false
	}
	if ok, err := pool.Take(ctx); err != nil || !ok {
		return false
	}
	for _, c := range claims {
		b.metrics.decisions.WithLabelValues(c.g.name, "lent").Inc()
	}
	b.metrics.turnWait.WithLabelValues(task.queue).Observe(0)
	// A lent turn cannot be given back alone: a task that does not use it
	// leaves it counted (see giveBack).
	return true
}

// giveBack gives back the turns of a task that will not use them, so that
// another task may.
func (b *booker) giveBack(ctx context.Context, held bookedTurns) {
	ctx = context.WithoutCancel(ctx)
	for i, c := range held.claims {
		b.metrics.evaluations.WithLabelValues(c.g.name).Inc()
		if err := c.lim.Cancel(ctx, c.key, held.turns[i]); err != nil {
			b.log.Warn("cannot give back a turn; it is lost", "gate", c.g.name, "err", err)
		}
	}
}
