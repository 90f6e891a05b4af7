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
	op := &algorithms.Op{Now: algorithms.Now, Name: st.op, NotBefore: st.notBefore, Ahead: st.ahead, MaxWait: st.maxWait, Exact: st.exact, Late: st.late, Remind: st.remind,
		Claims: make([]algorithms.OpClaim, 0, len(st.parts))}
	if first.clock != nil {
		op.Now, op.Slack = first.clock.Now().UnixMicro(), injectedClockSlack.Microseconds()
	}
	for i, p := range st.parts {
		l := p.lim.(*redisLimiter)
		state := redisKey(l.prefix, p.key)
		c := algorithms.OpClaim{Algorithm: l.spec.algorithm, Params: l.spec.params, Key: state, Aux: auxKey(state), N: p.n, ID: p.id}
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
	if err := s.calls.do(ctx, op); err != nil {
		return err
	}
	if op.Err != nil {
		var answered redis.Error
		if !errors.As(op.Err, &answered) {
			// No answer: the call may have run. It is not sent again (see
			// algorithms.Script.Run), so it cannot count twice; the caller's
			// failure policy decides.
			return fmt.Errorf("throttle: book script: no reply, so it may or may not have run on the server (it is not sent again): %w", op.Err)
		}
		return fmt.Errorf("throttle: book script: %w", op.Err)
	}
	st.out = op.Result
	return nil
}
