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
	rdb    redis.Scripter
	clock  Clock // nil: Redis TIME
	prefix string
}

// New returns a Limiter that keeps its state in Redis (or Redis Cluster: every
// call touches one key). Each AllowN is one atomic script run with Redis's
// clock, so any number of processes share the limit exactly.
//
// Redis errors are returned as they are. A script call that timed out may
// have run on the server: do not retry it blindly, or it counts twice.
func New(rdb redis.UniversalClient, spec Spec, opts ...Option) (Limiter, error) {
	c, err := compile(spec)
	if err != nil {
		return nil, err
	}
	o, err := applyOptions(spec, opts)
	if err != nil {
		return nil, err
	}
	return &redisLimiter{compiled: c, rdb: rdb, clock: o.clock, prefix: o.prefix}, nil
}

// call is one script run on key for n events.
func (l *redisLimiter) call(key string, n int) algorithms.Call {
	state := redisKey(l.prefix, key)
	c := algorithms.Call{Key: state, BlockKey: blockKey(state), Params: l.params, Now: algorithms.Now, N: int64(n)}
	if l.clock != nil {
		c.Now, c.Slack = l.clock.Now().UnixMicro(), injectedClockSlack.Microseconds()
	}
	return c
}

func (l *redisLimiter) fail(err error) error {
	return fmt.Errorf("throttle: %s script: %w", l.algorithm.Name, err)
}

// AllowN implements Limiter.
func (l *redisLimiter) AllowN(ctx context.Context, key string, n int) (Decision, error) {
	if err := l.checkCost(n); err != nil {
		return Decision{}, err
	}
	r, err := l.algorithm.Script.Allow(ctx, l.rdb, l.call(key, n))
	if err != nil {
		return Decision{}, l.fail(err)
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
	r, err := l.algorithm.Script.Reserve(ctx, l.rdb, l.call(key, n), unixMicros(notBefore), maxWait.Microseconds())
	if err != nil {
		return Reservation{}, l.fail(err)
	}
	return reservation(r, n), nil
}

// Peek implements Reserver.
func (l *redisLimiter) Peek(ctx context.Context, key string) (Level, error) {
	remaining, blockedFor, err := l.algorithm.Script.Peek(ctx, l.rdb, l.call(key, 1))
	if err != nil {
		return Level{}, l.fail(err)
	}
	return Level{Remaining: int(remaining), BlockedFor: micros(blockedFor)}, nil
}

// Block implements Reserver.
func (l *redisLimiter) Block(ctx context.Context, key string, d time.Duration) error {
	if d <= 0 {
		return nil
	}
	if _, err := l.algorithm.Script.Block(ctx, l.rdb, l.call(key, 1), d.Microseconds()); err != nil {
		return l.fail(err)
	}
	return nil
}

// Cancel implements Reserver.
func (l *redisLimiter) Cancel(ctx context.Context, key string, r Reservation) error {
	if err := l.checkReservation(r); err != nil {
		return err
	}
	if err := l.algorithm.Script.Cancel(ctx, l.rdb, l.call(key, r.N), r.At.UnixMicro()); err != nil {
		return l.fail(err)
	}
	return nil
}
