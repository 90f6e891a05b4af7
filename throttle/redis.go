package throttle

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/algorithms"
)

// injectedClockSlack is added to every TTL when a clock is injected: Redis
// expires keys by its own clock, which need not run with the injected one.
// The local engine keeps its state as long, so that both forget alike.
const injectedClockSlack = time.Minute

// redisLimiter keeps its state in Redis; its decisions are runs of the
// book script.
type redisLimiter struct {
	base
	calls  *batcher
	clock  Clock // nil: Redis TIME
	prefix string
	onErr  string
	twin   *localTwin // the local policy's in-process limit; nil for the others
	fair   *fairKeys  // a fair share (NewFairShare); nil for the limits
	recent bool       // WithRecentThrottles
	// replaces: the limit this one took the place of (Replacing), or nil;
	// its prefix and spec only, so that a chain of changes keeps no
	// limiter alive.
	replaces *replacedLimit
	// lean: its AllowN and ReserveN run its algorithm's lean script
	// alone (see reserveOne), with these arguments made once.
	lean *algorithms.LeanArgs
}

type replacedLimit struct {
	prefix string
	spec   compiled
}

var _ limiter = (*redisLimiter)(nil)

// New returns a limiter that keeps its state in Redis (or Redis Cluster):
// a Reserver, which can book turns ahead and give them back as well as
// decide now, and which Book can book together with other limiters. Each
// decision is one atomic script run with Redis's clock, so any number of
// processes share the limit exactly.
//
// Concurrent calls share round trips (see WithPipelining). Redis errors
// are returned as they are, unless WithOnRedisError says otherwise. A
// script call whose reply did not come (the connection broke, it timed out,
// its context ended) may have run on the server: the limiter never sends
// it again, whatever rdb's retry options (go-redis keeps retrying rdb's
// other commands), and returns an error; do not retry it blindly either,
// or it may count twice.
func New(rdb redis.UniversalClient, spec Spec, opts ...Option) (Reserver, error) {
	c, err := compile(spec)
	if err != nil {
		return nil, err
	}
	o, err := applyOptions(spec, opts)
	if err != nil {
		return nil, err
	}
	l := &redisLimiter{base: base{spec: c}, calls: batcherFor(rdb, o.inFlight), clock: o.clock, prefix: o.prefix, onErr: o.onRedisError, recent: o.recent}
	if o.replaces != nil {
		old, ok := o.replaces.(*redisLimiter)
		if !ok || old.fair != nil {
			return nil, fmt.Errorf("%w: Replacing: New replaces a limiter of New, got %T", ErrInvalidSpec, o.replaces)
		}
		if err := replacedOf(c, old.spec); err != nil {
			return nil, err
		}
		l.replaces = &replacedLimit{prefix: old.prefix, spec: old.spec}
	}
	l.base.self = l
	if l.replaces == nil && !l.recent {
		var slack int64
		if l.clock != nil {
			slack = injectedClockSlack.Microseconds()
		}
		l.lean = algorithms.NewLeanArgs(c.algorithm, c.params, slack)
	}
	if o.onRedisError == OnRedisErrorLocal {
		l.twin = &localTwin{spec: spec, shares: o.shares, clock: o.clock}
	}
	return l, nil
}

func (l *redisLimiter) site(key string) site {
	if l.calls.server != nil {
		return l.calls.server
	}
	if l.fair != nil {
		key = l.fair.tag // every key value's claim is on the one state
	}
	return redisSite{calls: l.calls, slot: slotOf(hashTag(key))}
}

func (l *redisLimiter) now() time.Time {
	if l.clock != nil {
		return l.clock.Now()
	}
	return time.Now()
}

func (l *redisLimiter) policy() (string, limiter) {
	if l.twin == nil {
		return l.onErr, nil
	}
	twin := l.twin.limiter()
	if twin == nil {
		return OnRedisErrorDeny, nil // the shares are not known yet
	}
	return l.onErr, twin
}

// redisSite is one cluster slot of one Redis (slot -1: a single server,
// where every key is in reach of one script).
type redisSite struct {
	calls *batcher
	slot  int
}

func (s redisSite) reaches(key string) bool {
	return s.slot < 0 || s.slot == keySlot(key)
}

func (s redisSite) run(ctx context.Context, st *step) error {
	first := st.parts[0].lim.(*redisLimiter)
	op := &algorithms.Op{Now: algorithms.Now, Name: st.op, NotBefore: st.notBefore, Ahead: st.ahead, MaxWait: st.maxWait, Exact: st.exact, RefusalsOnly: st.refusals, Late: st.late, KeepAfter: st.keepAfter, Remind: st.remind,
		Claims: make([]algorithms.OpClaim, 0, len(st.parts))}
	if first.clock != nil {
		op.Now, op.Slack = first.clock.Now().UnixMicro(), injectedClockSlack.Microseconds()
	}
	for i, p := range st.parts {
		l := p.lim.(*redisLimiter)
		state := redisKey(l.prefix, p.key)
		c := algorithms.OpClaim{Algorithm: l.spec.algorithm, Params: l.spec.params, Key: state, Aux: auxKey(state), N: p.n, ID: p.id, Lean: l.lean}
		if p.id != "" {
			c.KeptKey = keptKey(state, p.id)
		}
		if l.recent {
			c.RecentKey = recentKey(state)
		}
		if r := l.replaces; r != nil {
			old := redisKey(r.prefix, p.key)
			c.Replaces = &algorithms.Replaced{Algorithm: r.spec.algorithm, Params: r.spec.params, Key: old, Aux: auxKey(old)}
		}
		if l.fair != nil {
			state = redisKey(l.prefix, l.fair.tag)
			c.Key, c.Aux, c.Member = state, auxKey(state), hashTag(p.key)
			if p.id != "" {
				c.KeptKey = keptKey(state, p.id)
			}
			c.Params.Windows = int64(max(1, l.fair.weight(p.key)))
		}
		if st.giveBack != nil {
			c.GiveBack = st.giveBack[i]
		}
		op.Claims = append(op.Claims, c)
	}
	if st.ids != nil {
		op.Series = &algorithms.SeriesOp{IDs: st.ids, MinAhead: st.minAhead, Reminds: st.reminds, KeptKeys: make([]string, 0, len(st.ids)*len(op.Claims))}
		for _, id := range st.ids {
			for _, c := range op.Claims {
				op.Series.KeptKeys = append(op.Series.KeptKeys, keptKey(c.Key, id))
			}
		}
	}
	if err := s.calls.do(ctx, op); err != nil {
		return err
	}
	if err := opError(op); err != nil {
		return err
	}
	st.out = op.Result
	if op.Series != nil {
		st.series = op.Series.Booked
	}
	return nil
}

// opError is the error of op, once run, for the caller's failure policy.
func opError(op *algorithms.Op) error {
	if op.Err == nil {
		return nil
	}
	var answered redis.Error
	if !errors.As(op.Err, &answered) {
		// No answer: the call may have run. It is not sent again (see
		// algorithms.Script.Run), so it cannot count twice; the caller's
		// failure policy decides.
		return fmt.Errorf("throttle: book script: no reply, so it may or may not have run on the server (it is not sent again): %w", op.Err)
	}
	return fmt.Errorf("throttle: book script: %w", op.Err)
}

// AllowN implements Limiter: see reserveOne.
func (l *redisLimiter) AllowN(ctx context.Context, key string, n int) (Decision, error) {
	if l.lean == nil || l.fair != nil {
		return l.base.AllowN(ctx, key, n)
	}
	return decisionOf(l.reserveOne(ctx, key, n, time.Time{}, 0, false))
}

// ReserveN implements Reserver: see reserveOne.
func (l *redisLimiter) ReserveN(ctx context.Context, key string, n int, maxWait time.Duration) (Reservation, error) {
	return l.ReserveAfter(ctx, key, n, time.Time{}, maxWait)
}

// ReserveAfter implements Reserver: see reserveOne.
func (l *redisLimiter) ReserveAfter(ctx context.Context, key string, n int, notBefore time.Time, maxWait time.Duration) (Reservation, error) {
	if l.lean == nil || l.fair != nil {
		return l.base.ReserveAfter(ctx, key, n, notBefore, maxWait)
	}
	return l.reserveOne(ctx, key, n, notBefore, maxWait, true)
}

// leanCall is one claim's Op and the claim, in one allocation.
type leanCall struct {
	op    algorithms.Op
	claim [1]algorithms.OpClaim
}

// reserveOne is Book of one claim on a limit that its algorithm's lean
// script decides alone (no fair share, recent throttles or replaced limit;
// an AllowN or ReserveN has no ID and nothing to give back): the same
// outcome, without the parts, groups and steps that a Book of several
// claims needs, a fifth of the client's work on a decision. pieces: the
// caller may give the turn back (not AllowN).
func (l *redisLimiter) reserveOne(ctx context.Context, key string, n int, notBefore time.Time, maxWait time.Duration, pieces bool) (Reservation, error) {
	if maxWait < 0 {
		return Reservation{}, fmt.Errorf("%w: maxWait must be >= 0, got %v", ErrMisuse, maxWait)
	}
	if err := l.spec.checkCost(n); err != nil {
		return Reservation{}, err
	}
	wait := min(maxWait.Microseconds(), l.spec.horizon)
	c := &leanCall{}
	c.claim[0] = algorithms.OpClaim{Algorithm: l.spec.algorithm, Params: l.spec.params, Key: redisKey(l.prefix, key), N: int64(n), Lean: l.lean}
	if l.spec.algorithm == algorithms.SlidingLog {
		c.claim[0].Aux = auxKey(c.claim[0].Key)
	}
	c.op = algorithms.Op{Now: algorithms.Now, Name: algorithms.OpBook, NotBefore: unixMicros(notBefore), MaxWait: wait, Claims: c.claim[:], NoPieces: !pieces}
	if l.clock != nil {
		c.op.Now, c.op.Slack = l.clock.Now().UnixMicro(), injectedClockSlack.Microseconds()
	}
	err := l.calls.do(ctx, &c.op)
	if err == nil {
		err = opError(&c.op)
	}
	if err != nil {
		return l.reserveFailed(ctx, key, n, c.op.NotBefore, wait, err)
	}
	b := &c.op.Result
	t := &b.Claims[0]
	if !b.OK {
		// One claim: its own wait is the booking's.
		return Reservation{Delay: micros(max(0, t.RetryAfter, b.At-b.Now)), N: n, Remaining: int(t.Remaining), ResetAfter: micros(t.ResetAfter)}, nil
	}
	return Reservation{OK: true, Delay: micros(max(0, b.At-b.Now)), At: time.UnixMicro(b.At), N: n,
		Remaining: int(t.Remaining), ResetAfter: micros(t.ResetAfter), pieces: t.Pieces}, nil
}

// reserveFailed is reserveOne's outcome when Redis failed with err: its
// failure policy's, as Book's.
func (l *redisLimiter) reserveFailed(ctx context.Context, key string, n int, notBefore, maxWait int64, err error) (Reservation, error) {
	b := &booker{parts: []*part{{lim: l, key: key, n: int64(n)}}, notBefore: notBefore, maxWait: maxWait}
	g := &group{site: l.site(key), parts: b.parts}
	s := &step{op: algorithms.OpBook, parts: g.parts, notBefore: notBefore, maxWait: maxWait}
	if err := g.recover(ctx, s, err); err != nil {
		return Reservation{}, err
	}
	g.out, g.held, g.at = s.out, s.out.OK, s.out.At
	groups := []*group{g}
	var bk Booking
	if at, agreed := b.settle(groups); agreed {
		bk = b.success(groups, at)
	} else {
		bk = b.refusal(groups, at)
	}
	r := bk.Turns[0]
	if !r.OK {
		r.Delay = max(r.Delay, bk.Delay)
	}
	return r, nil
}
