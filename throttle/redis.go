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

// AllowN implements Limiter.
func (l *redisLimiter) AllowN(ctx context.Context, key string, n int) (Decision, error) {
	if err := l.checkCost(n); err != nil {
		return Decision{}, err
	}
	now, slack := algorithms.Now, int64(0)
	if l.clock != nil {
		now, slack = l.clock.Now().UnixMicro(), injectedClockSlack.Microseconds()
	}
	r, err := l.algorithm.Script.Run(ctx, l.rdb, redisKey(l.prefix, key), l.params, now, int64(n), slack)
	if err != nil {
		return Decision{}, fmt.Errorf("throttle: %s script: %w", l.algorithm.Name, err)
	}
	return decision(r), nil
}
