package jobs

import (
	"context"
	"errors"
	"maps"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/producer"
	"github.com/sluicehq/sluice/throttle"
)

// A sharded queue (queues.<q>.shards: N) is N asynq queues, its shards,
// named producer.ShardQueue(q, N, i) ("q~0", "q~1", ...): asynq keeps one
// queue under one hash tag, so one queue is one Redis Cluster master's
// work, and the shards' names put them in slots spread over the masters.
// Producers spread the tasks over the shards (producer.Spread); workers
// serve every shard; each shard has a drain of its own, in its own slot
// beside asynq's keys of the shard, so that the drain's scripts spread
// over the masters too.
//
// The drain's rate R is shared among the shards: shard i drains at
// R·u_i/U, where U = shareUnit·N and the u_i add up to U, so the total is
// R exactly. A shard drains at an equal share while every shard has
// tasks; one without any (none pending, active, or due back from Redis
// within shareSoon) for shareIdleAfter keeps one unit (about 1/1000 of
// an equal share: its next task gets its turn at once, from its share of
// the burst) and the rest goes to the shards that have tasks. A shard's
// share is a live change of its drain's rate: the limiter at the new rate
// takes over what the old one counted (throttle.Replacing), tasks waiting
// for turns booked at the old rate book again, as for `enqueue limits
// set`. Which shards have tasks is looked at every shareLook by one
// worker of the fleet (a claim in Redis, per queue) and kept in Redis
// (sharesKey); every worker reads it as often and hears of a change on
// the block board's channel at once. The burst is split among the shards
// (each at least 1), not by the shares.
const (
	shareUnit      = 1000
	shareLook      = 250 * time.Millisecond
	shareIdleLooks = 3 // looks without a task: shareIdleAfter
	shareIdleAfter = shareIdleLooks * shareLook
	shareSoon      = 2 * time.Second
	// sharesNotice is published on blockChannel when a sharded queue's
	// shares changed.
	sharesNotice = "shares"
	// maxWeightSum bounds the priorities of the asynq queues a worker
	// serves, added up: asynq builds a list that long for every dequeue.
	maxWeightSum = 1000
)

// validateShards checks queue name's shards, at key.
func (q QueueConfig) validateShards(key, name string) []error {
	var errs []error
	bad := func(key, format string, args ...any) {
		errs = append(errs, configProblem(key, format, args...))
	}
	if q.shardOf == "" && strings.Contains(name, producer.ShardSep) {
		bad(key, "%q is reserved for the shards of a sharded queue (queues.<q>.shards); name the queue without it", producer.ShardSep)
	}
	if q.Shards < 1 || q.Shards > producer.MaxShards {
		bad(key+".shards", "must be from 1 (one asynq queue, the default) to %d, got %d", producer.MaxShards, q.Shards)
	}
	if q.Shards <= 1 {
		return errs
	}
	if d := q.Drain; d != nil {
		switch {
		case d.Algorithm != string(throttle.LeakyBucket) && d.Algorithm != string(throttle.TokenBucket):
			bad(key+".shards", "needs a bucket drain (leaky_bucket or token_bucket) to share among the shards, got %s: a window's limit per period cannot be split by rate", d.Algorithm)
		case d.Key != "":
			bad(key+".shards", "cannot split a keyed drain (%s.drain.key): each key value has a drain of its own, in a slot of its own, already", key)
		}
	}
	if q.Fairness != nil {
		bad(key+".shards", "cannot split a fair queue (%s.fairness): its keys' lines are the queue's", key)
	}
	return errs
}

// sharded returns c with each sharded queue replaced by its shards (a
// config with none is c as it is). busy says, by sharded queue, which of
// its shards have tasks (nil or absent: all), and so each one's share of
// the drain. The priorities are scaled so that a sharded queue's shards
// together weigh what the queue does against the others: every queue's
// by the least common multiple m of the shard counts, a shard's p·m/N;
// where that would add up past maxWeightSum, a shard weighs p/N rounded
// (at least 1) and the others p.
func (c Config) sharded(busy map[string][]bool) Config {
	m, sum := 1, 0
	for _, q := range c.Queues {
		if q.Shards > 1 {
			m = lcm(m, q.Shards)
		}
		sum += q.Priority
	}
	if m == 1 {
		return c
	}
	if m*sum > maxWeightSum {
		m = 1
	}
	queues := make(map[string]QueueConfig, len(c.Queues))
	for name, q := range c.Queues {
		if q.Shards <= 1 {
			q.Priority *= m
			queues[name] = q
			continue
		}
		n := q.Shards
		units := shareUnits(n, busy[name])
		var bursts []int
		if q.Drain != nil {
			bursts = splitEven(q.Drain.Spec().WithDefaults().Burst, n)
		}
		for i, shard := range producer.ShardQueues(name, n) {
			s := q
			s.Shards, s.shardOf = 1, name
			s.Priority = max(1, (q.Priority*m+n/2)/n)
			if q.Drain != nil {
				d := *q.Drain
				d.Limit *= units[i]
				d.Period *= time.Duration(shareUnit * n)
				d.Burst = bursts[i]
				s.Drain = &d
			}
			queues[shard] = s
		}
	}
	c.Queues = queues
	return c
}

// shareUnits are n shards' shares of their drain, in units of 1/(n·
// shareUnit) of it: equal when busy is nil or says all or none of them
// have tasks; else one unit for each idle shard and the rest split
// evenly among the busy ones.
func shareUnits(n int, busy []bool) []int {
	units := make([]int, n)
	idle := 0
	for i := range units {
		if i < len(busy) && !busy[i] {
			idle++
		}
	}
	if len(busy) != n || idle == 0 || idle == n {
		for i := range units {
			units[i] = shareUnit
		}
		return units
	}
	rest := splitEven(shareUnit*n-idle, n-idle)
	for i := range units {
		if busy[i] {
			units[i], rest = rest[0], rest[1:]
		} else {
			units[i] = 1
		}
	}
	return units
}

// splitEven splits total into n parts that differ by at most one, the
// larger first, each at least 1 (so they add up to max(total, n)).
func splitEven(total, n int) []int {
	parts := make([]int, n)
	for i := range parts {
		parts[i] = max(1, total/n)
		if i < total%n {
			parts[i]++
		}
	}
	return parts
}

func lcm(a, b int) int {
	x, y := a, b
	for y != 0 {
		x, y = y, x%y
	}
	return a / x * b
}

// shardsOf lists, by sharded queue, its shards' asynq queues in shard
// order, of cfg as sharded.
func shardsOf(cfg Config) map[string][]string {
	count := map[string]int{}
	for _, q := range cfg.Queues {
		if q.shardOf != "" {
			count[q.shardOf]++
		}
	}
	groups := make(map[string][]string, len(count))
	for queue, n := range count {
		groups[queue] = producer.ShardQueues(queue, n)
	}
	return groups
}

// logicalQueue is the queue a task of asynq queue queue counts for: its
// sharded queue if it is a shard of one in cfg, else queue.
func logicalQueue(cfg Config, queue string) string {
	if q := cfg.Queues[queue].shardOf; q != "" {
		return q
	}
	return queue
}

// shareKeeper keeps the shares of every sharded queue's drain: every
// shareLook one worker of the fleet looks which shards have tasks and
// writes it to Redis, and every worker reads it and puts a change in
// force with apply.
type shareKeeper struct {
	fleetDeps
	apply   func(busy map[string][]bool)
	changed chan struct{}
	busy    map[string][]bool // as last applied
}

func newShareKeeper(deps fleetDeps, apply func(map[string][]bool)) *shareKeeper {
	return &shareKeeper{fleetDeps: deps, apply: apply, changed: make(chan struct{}, 1)}
}

// poke has run read the shares now: a worker announced a change.
func (k *shareKeeper) poke() {
	select {
	case k.changed <- struct{}{}:
	default:
	}
}

func (k *shareKeeper) run(ctx context.Context) {
	tick := time.NewTicker(shareLook)
	defer tick.Stop()
	for {
		groups := shardsOf(k.gates().cfg)
		if len(groups) > 0 {
			k.round(ctx, groups)
		}
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		case <-k.changed:
		}
	}
}

// round looks at the shards of each sharded queue whose claim this worker
// wins, then reads every queue's shares and applies them if they changed.
func (k *shareKeeper) round(ctx context.Context, groups map[string][]string) {
	busy := make(map[string][]bool, len(groups))
	for _, queue := range slices.Sorted(maps.Keys(groups)) {
		shards := groups[queue]
		if ok, err := k.rdb.SetNX(ctx, sharerClaim(queue), k.worker, shareLook).Result(); err == nil && ok {
			if err := k.look(ctx, queue, shards); err != nil && ctx.Err() == nil {
				k.log.Warn("cannot look at a sharded queue's shards; their shares stay", "queue", queue, "err", err)
			}
		}
		stored, err := k.rdb.HGet(ctx, sharesKey(queue), "busy").Result()
		if err != nil && !errors.Is(err, redis.Nil) {
			return // the shares in force stay
		}
		busy[queue] = parseBusy(stored, len(shards))
	}
	if !maps.EqualFunc(busy, k.busy, slices.Equal) {
		k.busy = busy
		k.apply(busy)
	}
}

// look counts the tasks of each shard of queue (pending, active, and due
// back from Redis within shareSoon) and stores, for each, how many looks
// in a row found none (up to shareIdleLooks), and which shards are busy:
// those with tasks at one of the last shareIdleLooks looks. A change is
// announced on blockChannel.
func (k *shareKeeper) look(ctx context.Context, queue string, shards []string) error {
	soon := strconv.FormatInt(time.Now().Add(shareSoon).Unix(), 10)
	pipe := k.queues.Pipeline()
	counts := make([][]*redis.IntCmd, len(shards))
	for i, shard := range shards {
		a := asynqKeys(shard)
		counts[i] = []*redis.IntCmd{pipe.LLen(ctx, a+"pending"), pipe.LLen(ctx, a+"active"),
			pipe.ZCount(ctx, a+"scheduled", "-inf", soon), pipe.ZCount(ctx, a+"retry", "-inf", soon)}
	}
	if _, err := pipe.Exec(ctx); err != nil {
		return err
	}
	stored, err := k.rdb.HMGet(ctx, sharesKey(queue), "busy", "quiet").Result()
	if err != nil {
		return err
	}
	was, _ := stored[0].(string)
	quietText, _ := stored[1].(string)
	// Looks are counted, not timed: the workers that look in turn need not
	// agree on the time.
	quiet := strings.Split(quietText, ",")
	quiet = append(quiet, make([]string, max(0, len(shards)-len(quiet)))...)[:len(shards)]
	busy := make([]byte, len(shards))
	for i, c := range counts {
		var n int64
		for _, cmd := range c {
			n += cmd.Val()
		}
		looks, err := strconv.Atoi(quiet[i])
		if err != nil {
			looks = shareIdleLooks // never looked at: idle until it has tasks
		}
		if n > 0 {
			looks = 0
		} else {
			looks = min(looks+1, shareIdleLooks)
		}
		quiet[i] = strconv.Itoa(looks)
		busy[i] = '0'
		if looks < shareIdleLooks {
			busy[i] = '1'
		}
	}
	pipe = k.rdb.TxPipeline()
	pipe.HSet(ctx, sharesKey(queue), "busy", string(busy), "quiet", strings.Join(quiet, ","))
	pipe.Expire(ctx, sharesKey(queue), time.Hour)
	if _, err := pipe.Exec(ctx); err != nil {
		return err
	}
	if was != string(busy) {
		k.log.Info("a sharded queue's drain is shared anew", "queue", queue, "busy", string(busy))
		return k.rdb.Publish(ctx, blockChannel, sharesNotice).Err()
	}
	return nil
}

// storedShares reads which shards of each sharded queue of cfg (not
// sharded yet) have tasks, as the fleet last said.
func storedShares(ctx context.Context, rdb redis.UniversalClient, cfg Config) (map[string][]bool, error) {
	busy := map[string][]bool{}
	for _, name := range sortedKeys(cfg.Queues) {
		if n := cfg.Queues[name].Shards; n > 1 {
			stored, err := rdb.HGet(ctx, sharesKey(name), "busy").Result()
			if err != nil && !errors.Is(err, redis.Nil) {
				return nil, err
			}
			busy[name] = parseBusy(stored, n)
		}
	}
	return busy, nil
}

// parseBusy reads a stored "busy" field: '1' for each shard with tasks;
// nil (every shard its equal share) if it is not one for n shards.
func parseBusy(stored string, n int) []bool {
	if len(stored) != n {
		return nil
	}
	busy := make([]bool, n)
	for i := range busy {
		busy[i] = stored[i] == '1'
	}
	return busy
}
