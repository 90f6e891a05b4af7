package throttle

import (
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/algorithms"
)

// FairSpec describes a queue's fair share: how deep a future of its
// drain is shared, and the weight of each key value.
type FairSpec struct {
	// Drain is the drain's rate (Limit per Period); the shares are of
	// Depth events of it, booked ahead.
	Limit  int
	Period time.Duration
	// Depth is how many events (of cost) all keys together may hold
	// booked ahead: each key value at most w·max(1, Depth/W) (W the
	// weights of the keys active now, the division rounded down), so that
	// the weights' ratio is exact at any depth; Depth when it is the only
	// key active; and always one claim. All together hold at most
	// max(Depth, W).
	Depth int
	// Weight gives a key value's weight (>= 1); nil: 1 for all.
	Weight func(key string) int
}

// NewFairShare returns a limiter whose claims, booked with the claims of a
// queue's drain (Book), hold every key value to its weighted share of the
// drain's booked future: a claim that would hold more is refused (its
// Delay is beyond any wait), and the caller lets its task wait in its
// key's line (see the wake script). All its state lives under the hash tag
// of tag (the queue), in one slot with the drain's keys when the drain's
// key is tag too, so that both are booked in one script run. It exists
// only on Redis: when Redis fails, its claims are let through (the drain
// applies its own policy). WithPrefix and WithClock apply as for New.
func NewFairShare(rdb redis.UniversalClient, tag string, spec FairSpec, opts ...Option) (Reserver, error) {
	drain := Spec{Algorithm: LeakyBucket, Limit: spec.Limit, Period: spec.Period, Burst: max(1, spec.Depth)}
	c, err := compile(drain)
	if err != nil {
		return nil, err
	}
	if spec.Depth < 1 {
		return nil, &SpecError{Field: "Depth", Problem: fmt.Sprintf("must be >= 1, got %d", spec.Depth)}
	}
	c.algorithm = algorithms.FairShare
	c.horizon = maxHorizon
	o, err := applyOptions(Spec{Algorithm: Algorithm(algorithms.FairShare.Name)}, append([]Option{WithOnRedisError(OnRedisErrorAllow, nil)}, opts...))
	if err != nil {
		return nil, err
	}
	weight := spec.Weight
	if weight == nil {
		weight = func(string) int { return 1 }
	}
	l := &redisLimiter{base: base{spec: c}, calls: batcherFor(rdb, o.inFlight), clock: o.clock, prefix: o.prefix,
		onErr: OnRedisErrorAllow, fair: &fairKeys{tag: tag, weight: weight}}
	l.base.self = l
	return l, nil
}

// fairKeys is what makes a redisLimiter a fair share: every key value's
// claim is on one state, under tag.
type fairKeys struct {
	tag    string
	weight func(key string) int
}

// FairKeys returns the Redis keys of the fair share state under tag with
// prefix (state, aux, lines, keys: see lua/fair.lua; and the recent
// throttles by key value, see Loads), for the script that keeps the lines.
func FairKeys(prefix, tag string) []string {
	state := redisKey(prefix, tag)
	return []string{state, auxKey(state), state + ":l", state + ":k", recentKey(state)}
}

// FairMember is a key value as the fair share state names it.
func FairMember(key string) string { return hashTag(key) }
