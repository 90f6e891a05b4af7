package throttle

import (
	"context"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/algorithms"
)

// injectedClockSlack is added to every TTL when a clock is injected: Redis
// expires keys by its own clock, which need not run with the injected one.
// The local engine keeps its state as long, so that both forget alike.
const injectedClockSlack = time.Minute

// redisLimiter runs each decision as one script call on Redis.
type redisLimiter struct {
	compiled
	calls  *batcher
	clock  Clock // nil: Redis TIME
	prefix string
}

// New returns a Limiter that keeps its state in Redis (or Redis Cluster: every
// call touches one key). Each AllowN is one atomic script run with Redis's
// clock, so any number of processes share the limit exactly.
//
// Concurrent calls share round trips (see WithPipelining). Redis errors are
// returned as they are. A script call that timed out, or whose context
// ended, may have run on the server: do not retry it blindly, or it counts
// twice.
func New(rdb redis.UniversalClient, spec Spec, opts ...Option) (Limiter, error) {
	c, err := compile(spec)
	if err != nil {
		return nil, err
	}
	o, err := applyOptions(spec, opts)
	if err != nil {
		return nil, err
	}
	calls := &batcher{rdb: rdb, script: c.algorithm.Script, maxInFlight: o.inFlight}
	return &redisLimiter{compiled: c, calls: calls, clock: o.clock, prefix: o.prefix}, nil
}

// run runs the script's operation name on key for n events.
func (l *redisLimiter) run(ctx context.Context, key string, n int, name string, arg, notBefore int64) (algorithms.Result, error) {
	state := redisKey(l.prefix, key)
	op := &algorithms.Op{
		Call: algorithms.Call{Key: state, BlockKey: blockKey(state), Params: l.params, Now: algorithms.Now, N: int64(n)},
		Name: name, Arg: arg, NotBefore: notBefore,
	}
	if l.clock != nil {
		op.Now, op.Slack = l.clock.Now().UnixMicro(), injectedClockSlack.Microseconds()
	}
	if err := l.calls.do(ctx, op); err != nil {
		return algorithms.Result{}, l.fail(err)
	}
	if op.Err != nil {
		return algorithms.Result{}, l.fail(op.Err)
	}
	return op.Result, nil
}

func (l *redisLimiter) fail(err error) error {
	return fmt.Errorf("throttle: %s script: %w", l.algorithm.Name, err)
}

// AllowN implements Limiter.
func (l *redisLimiter) AllowN(ctx context.Context, key string, n int) (Decision, error) {
	if err := l.checkCost(n); err != nil {
		return Decision{}, err
	}
	r, err := l.run(ctx, key, n, algorithms.OpAllow, 0, 0)
	if err != nil {
		return Decision{}, err
	}
	return decision(r), nil
}

// ReserveN implements Reserver.
func (l *redisLimiter) ReserveN(ctx context.Context, key string, n int, maxWait time.Duration) (Reservation, error) {
	return l.ReserveAfter(ctx, key, n, time.Time{}, maxWait)
}

// ReserveAfter implements Reserver.
func (l *redisLimiter) ReserveAfter(ctx context.Context, key string, n int, notBefore time.Time, maxWait time.Duration) (Reservation, error) {
	if err := l.checkReserve(n, maxWait); err != nil {
		return Reservation{}, err
	}
	r, err := l.run(ctx, key, n, algorithms.OpReserve, maxWait.Microseconds(), unixMicros(notBefore))
	if err != nil {
		return Reservation{}, err
	}
	return reservation(r, n), nil
}

// Peek implements Reserver.
func (l *redisLimiter) Peek(ctx context.Context, key string) (Level, error) {
	r, err := l.run(ctx, key, 1, algorithms.OpPeek, 0, 0)
	if err != nil {
		return Level{}, err
	}
	return Level{Remaining: int(r.Remaining), BlockedFor: micros(r.RetryAfter)}, nil
}

// Block implements Reserver.
func (l *redisLimiter) Block(ctx context.Context, key string, d time.Duration) error {
	if d <= 0 {
		return nil
	}
	_, err := l.run(ctx, key, 1, algorithms.OpBlock, d.Microseconds(), 0)
	return err
}

// Cancel implements Reserver.
func (l *redisLimiter) Cancel(ctx context.Context, key string, r Reservation) error {
	if err := l.checkReservation(r); err != nil {
		return err
	}
	_, err := l.run(ctx, key, r.N, algorithms.OpCancel, r.At.UnixMicro(), 0)
	return err
}
