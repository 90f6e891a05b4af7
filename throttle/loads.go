package throttle

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/algorithms"
	"github.com/sluicehq/sluice/lua"
)

// KeyLoad is one key of a limiter, fair share or semaphore as Redis holds
// it now: what Loads reports.
//
// A token bucket of 4/s, burst 4, whose key has just admitted 4 events and
// booked turns for 6 more (they waited), all within the minute: Waiting 6,
// Throttled 6, CanAdmit false, Remaining 0.
type KeyLoad struct {
	// Key is the key value. One too long to be kept as it is (see Key) is
	// known only by its hash, "#" and 32 hex digits.
	Key string
	// Waiting is how many events wait on the key: the turns booked on it
	// that are still to come (token and leaky buckets) and, on a fair
	// share, the tasks in the key's line too. -1: the algorithm does not
	// tell (windows, semaphores).
	Waiting int
	// Throttled is how many events the key throttled in the last minute
	// (counted in steps of 10s, so the minute may reach back 70s); 0 unless
	// the limiter counts them (WithRecentThrottles; fair shares always do).
	Throttled int
	// CanAdmit tells whether one event (a semaphore: one holder) would be
	// admitted now; Remaining is how many would.
	CanAdmit  bool
	Remaining int
}

// recentStep and recentSteps are the ring's steps (common.lua).
const (
	recentStep  = 10 * time.Second
	recentSteps = 7
)

// recentThrottled sums the steps of ring (common.lua's recent_add) that
// overlap the minute before now.
func recentThrottled(ring string, now time.Time) int {
	from := now.Add(-time.Minute).UnixMicro() / recentStep.Microseconds()
	v := strings.Fields(ring)
	sum := 0
	for i := 0; i+1 < len(v); i += 2 {
		b, err1 := strconv.ParseInt(v[i], 10, 64)
		n, err2 := strconv.Atoi(v[i+1])
		if err1 == nil && err2 == nil && b >= from {
			sum += n
		}
	}
	return sum
}

// unTag is the key value a hash tag was made from (hashTag), or the tag
// itself when it is a hash.
func unTag(tag string) string {
	if tag == "%" {
		return ""
	}
	if strings.HasPrefix(tag, "#") || !strings.Contains(tag, "%") {
		return tag
	}
	var b strings.Builder
	for i := 0; i < len(tag); i++ {
		if tag[i] == '%' && i+2 < len(tag) {
			if x, err := strconv.ParseUint(tag[i+1:i+3], 16, 8); err == nil {
				b.WriteByte(byte(x))
				i += 2
				continue
			}
		}
		b.WriteByte(tag[i])
	}
	return b.String()
}

// scanTags calls fn with the prefix, the tag and the rest of every key
// that begins with one of prefixes + "{", on every master of a cluster: in
// one pass over the keyspace (a SCAN visits every key, whatever it
// matches), however many prefixes. fn may be called from several
// goroutines at once.
func scanTags(ctx context.Context, rdb redis.UniversalClient, prefixes []string, fn func(prefix, tag, rest string)) error {
	common := prefixes[0]
	wanted := map[string]bool{}
	for _, p := range prefixes {
		wanted[p] = true
		for !strings.HasPrefix(p, common) {
			common = common[:len(common)-1]
		}
	}
	match := globEscape(common) + "{*"
	if len(wanted) > 1 {
		match = globEscape(common) + "*{*"
	}
	scan := func(ctx context.Context, c redis.Cmdable) error {
		it := c.Scan(ctx, 0, match, 1000).Iterator()
		for it.Next(ctx) {
			// No prefix holds '{' (WithPrefix): the first opens the tag.
			key := it.Val()
			open := strings.IndexByte(key, '{')
			prefix, tagged := key[:open], key[open+1:]
			if end := strings.IndexByte(tagged, '}'); end >= 0 && wanted[prefix] {
				fn(prefix, tagged[:end], tagged[end+1:])
			}
		}
		return it.Err()
	}
	if cc, ok := rdb.(*redis.ClusterClient); ok {
		return cc.ForEachMaster(ctx, func(ctx context.Context, c *redis.Client) error { return scan(ctx, c) })
	}
	return scan(ctx, rdb)
}

// globEscape makes s match itself in a SCAN pattern.
func globEscape(s string) string {
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		// Bytewise: a common prefix may end inside a UTF-8 sequence.
		if strings.IndexByte(`*?[]\`, s[i]) >= 0 {
			b.WriteByte('\\')
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// redisNow is the time on the clock of lim's scripts.
func redisNow(ctx context.Context, rdb redis.UniversalClient, clock Clock) (time.Time, error) {
	if clock != nil {
		return clock.Now(), nil
	}
	return rdb.Time(ctx).Result()
}

// maxLoadsBatch bounds the reads sent in one pipeline.
const maxLoadsBatch = 1000

// Loads lists every key of lims (each from New or NewFairShare, all on
// one Redis client) that holds state in Redis or throttled an event in the
// last minute, in no order. It scans the keyspace on every server once for
// all of them (Redis SCAN: a look over every key, however many), so it is
// for operators, not for every task; it counts nothing (a look may clean
// up what has expired).
func Loads(ctx context.Context, lims ...Limiter) ([]KeyLoad, error) {
	var loads []KeyLoad
	var rdb redis.UniversalClient
	byPrefix := map[string]*redisLimiter{}
	for _, lim := range lims {
		l, ok := lim.(*redisLimiter)
		if !ok {
			return nil, fmt.Errorf("throttle: Loads: %T is not a Redis limiter (New or NewFairShare)", lim)
		}
		if rdb == nil {
			rdb = l.calls.rdb
		} else if l.calls.rdb != rdb {
			return nil, errors.New("throttle: Loads: the limiters are on different Redis clients; call it once for each")
		}
		if l.fair != nil {
			fair, err := l.fairLoads(ctx)
			if err != nil {
				return nil, err
			}
			loads = append(loads, fair...)
			continue
		}
		byPrefix[l.prefix] = l
	}
	if len(byPrefix) == 0 {
		return loads, nil
	}
	// A key with a state, or only its recent throttles.
	type found struct {
		l     *redisLimiter
		tag   string
		state bool
	}
	var mu sync.Mutex
	tags := map[[2]string]*found{} // by prefix and tag
	err := scanTags(ctx, rdb, slices.Collect(maps.Keys(byPrefix)), func(prefix, tag, rest string) {
		if rest != "" && rest != ":x" {
			return
		}
		mu.Lock()
		defer mu.Unlock()
		f := tags[[2]string{prefix, tag}]
		if f == nil {
			f = &found{l: byPrefix[prefix], tag: tag}
			tags[[2]string{prefix, tag}] = f
		}
		f.state = f.state || rest == ""
	})
	if err != nil {
		return nil, fmt.Errorf("throttle: Loads: scan: %w", err)
	}
	var redisTime time.Time
	for _, l := range byPrefix {
		if l.clock == nil {
			if redisTime, err = redisNow(ctx, rdb, nil); err != nil {
				return nil, fmt.Errorf("throttle: Loads: time: %w", err)
			}
			break
		}
	}
	nowOf := func(l *redisLimiter) time.Time {
		if l.clock != nil {
			return l.clock.Now()
		}
		return redisTime
	}
	order := slices.Collect(maps.Values(tags))
	for start := 0; start < len(order); start += maxLoadsBatch {
		batch := order[start:min(len(order), start+maxLoadsBatch)]
		ops := make([]*algorithms.Op, len(batch))
		var peeks []*algorithms.Op
		for i, f := range batch {
			if !f.state {
				continue // no state: idle (a look must not write one)
			}
			state := f.l.prefix + "{" + f.tag + "}"
			ops[i] = &algorithms.Op{Now: algorithms.Now, Name: algorithms.OpPeek, Claims: []algorithms.OpClaim{{
				Algorithm: f.l.spec.algorithm, Params: f.l.spec.params, Key: state, Aux: auxKey(state), N: 1,
			}}}
			if f.l.clock != nil {
				ops[i].Now, ops[i].Slack = nowOf(f.l).UnixMicro(), injectedClockSlack.Microseconds()
			}
			peeks = append(peeks, ops[i])
		}
		if len(peeks) > 0 {
			algorithms.BookScript.Run(ctx, rdb, peeks...)
		}
		rings := make([]*redis.StringCmd, len(batch))
		_, err := rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
			for i, f := range batch {
				rings[i] = p.Get(ctx, recentKey(f.l.prefix+"{"+f.tag+"}"))
			}
			return nil
		})
		if err != nil && !errors.Is(err, redis.Nil) {
			return nil, fmt.Errorf("throttle: Loads: %w", err)
		}
		for i, f := range batch {
			spec := f.l.spec
			c := algorithms.Counted{Remaining: spec.idleRoom()}
			if op := ops[i]; op != nil {
				if op.Err != nil {
					return nil, fmt.Errorf("throttle: Loads: peek: %w", op.Err)
				}
				c = op.Result.Claims[0]
			}
			load := KeyLoad{Key: unTag(f.tag), Waiting: -1, Throttled: recentThrottled(rings[i].Val(), nowOf(f.l)),
				Remaining: int(c.Remaining), CanAdmit: c.Remaining > 0}
			switch Algorithm(spec.algorithm.Name) {
			case TokenBucket, LeakyBucket:
				// Each event takes Period/Limit of the bucket's time, and a turn
				// comes once its time is within Burst events of now.
				p := spec.params
				load.Waiting = int(max(0, ceilDiv(c.ResetAfter*p.Limit, p.Period)-p.Burst))
			}
			loads = append(loads, load)
		}
	}
	return loads, nil
}

func ceilDiv(a, b int64) int64 { return (a + b - 1) / b }

// idleRoom is how many events a key with no state admits: a bucket's
// burst, a window's limit.
func (c compiled) idleRoom() int64 {
	switch Algorithm(c.algorithm.Name) {
	case TokenBucket, LeakyBucket:
		return c.params.Burst
	}
	return c.params.Limit
}

// fairLoads reads a fair share's one state: every active key value, and
// those that waited in their line in the last minute.
func (l *redisLimiter) fairLoads(ctx context.Context) ([]KeyLoad, error) {
	rdb := l.calls.rdb
	keys := FairKeys(l.prefix, l.fair.tag)
	// Trim first, as every script does: turns that have passed no longer count.
	op := &algorithms.Op{Now: algorithms.Now, Name: algorithms.OpPeek, Claims: []algorithms.OpClaim{{
		Algorithm: l.spec.algorithm, Params: l.spec.params, Key: keys[0], Aux: keys[1], N: 1, Member: "%",
	}}}
	now, err := redisNow(ctx, rdb, l.clock)
	if err != nil {
		return nil, fmt.Errorf("throttle: Loads: time: %w", err)
	}
	if l.clock != nil {
		op.Now, op.Slack = now.UnixMicro(), injectedClockSlack.Microseconds()
	}
	algorithms.BookScript.Run(ctx, rdb, op)
	if op.Err != nil {
		return nil, fmt.Errorf("throttle: Loads: %w", op.Err)
	}
	state, err := rdb.HGetAll(ctx, keys[0]).Result()
	if err != nil {
		return nil, fmt.Errorf("throttle: Loads: %w", err)
	}
	rings, err := rdb.HGetAll(ctx, keys[4]).Result()
	if err != nil {
		return nil, fmt.Errorf("throttle: Loads: %w", err)
	}
	num := func(field string) int64 {
		n, _ := strconv.ParseInt(state[field], 10, 64)
		return n
	}
	members := map[string]bool{}
	for field := range state {
		if m, ok := strings.CutPrefix(field, "w:"); ok {
			members[m] = true
		}
	}
	for m := range rings {
		if m != "%swept" {
			members[m] = true
		}
	}
	depth, total := l.spec.params.Burst, num("W")
	loads := make([]KeyLoad, 0, len(members))
	for m := range members {
		key := unTag(m)
		held, weight := num("c:"+m), num("w:"+m)
		W := total
		if weight == 0 { // not active: it would be, with its weight
			weight = int64(max(1, l.fair.weight(key)))
			W += weight
		}
		// lua/fair.lua's fair_fits and room.
		load := KeyLoad{Key: key, Waiting: int(num("p:"+m) + max(0, held)), Throttled: recentThrottled(rings[m], now),
			CanAdmit: held <= 0 || (held+1)*W <= depth*weight, Remaining: int(max(0, depth*weight/W-held))}
		loads = append(loads, load)
	}
	return loads, nil
}

// Loads lists every key of s that has holders or refused one in the last
// minute (WithRecentThrottles), in no order: Remaining is its free slots,
// Waiting is -1 (unknown). It scans s's prefix, as Loads does.
func (s *Semaphore) Loads(ctx context.Context) ([]KeyLoad, error) {
	var mu sync.Mutex
	var tags []string
	err := scanTags(ctx, s.rdb, []string{s.prefix}, func(_, tag, rest string) {
		if rest == "" || rest == ":x" {
			mu.Lock()
			tags = append(tags, tag)
			mu.Unlock()
		}
	})
	if err != nil {
		return nil, fmt.Errorf("throttle: semaphore Loads: scan: %w", err)
	}
	now, err := redisNow(ctx, s.rdb, s.clock)
	if err != nil {
		return nil, fmt.Errorf("throttle: semaphore Loads: time: %w", err)
	}
	seen := map[string]bool{}
	var loads []KeyLoad
	for start := 0; start < len(tags); start += maxLoadsBatch {
		batch := tags[start:min(len(tags), start+maxLoadsBatch)]
		holders := make([]*redis.IntCmd, len(batch))
		rings := make([]*redis.StringCmd, len(batch))
		_, err := s.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
			for i, tag := range batch {
				key := s.prefix + "{" + tag + "}"
				holders[i] = p.ZCount(ctx, key, "("+strconv.FormatInt(now.UnixMicro(), 10), "+inf")
				rings[i] = p.Get(ctx, recentKey(key))
			}
			return nil
		})
		if err != nil && !errors.Is(err, redis.Nil) {
			return nil, fmt.Errorf("throttle: semaphore Loads: %w", err)
		}
		for i, tag := range batch {
			if seen[tag] {
				continue
			}
			seen[tag] = true
			free := max(0, s.limit-int(holders[i].Val()))
			loads = append(loads, KeyLoad{Key: unTag(tag), Waiting: -1, Throttled: recentThrottled(rings[i].Val(), now),
				CanAdmit: free > 0, Remaining: free})
		}
	}
	return loads, nil
}

// ScanKeys calls fn with the key (as given to Key) of every Redis key
// Key(prefix, key) made, on every master of a cluster, until fn returns
// false; fn is called from one goroutine at a time. A key longer than a
// hash tag holds is given as its tag ('#' and a hash).
func ScanKeys(ctx context.Context, rdb redis.UniversalClient, prefix string, fn func(key string) bool) error {
	var mu sync.Mutex
	done := false
	return scanTags(ctx, rdb, []string{prefix}, func(_, tag, rest string) {
		mu.Lock()
		defer mu.Unlock()
		if rest == "" && !done {
			done = !fn(unTag(tag))
		}
	})
}

var recentScript = redis.NewScript(lua.Recent)

// NoteThrottled counts n events of key as throttled now in lim's recent
// throttles (WithRecentThrottles, which Loads reads), as a Book that key's
// limit refused would: for callers that throttle events without a Book of
// their own (sluice gives a run of tasks tickets in a backlog line in one
// step, and their Books at their tickets count only refusals: see
// RecentRefusalsOnly). One script run on a limiter of New with
// WithRecentThrottles; nothing on one without, or of NewLocal, which
// count none.
func NoteThrottled(ctx context.Context, lim Limiter, key string, n int) error {
	switch l := lim.(type) {
	case *redisLimiter:
		if !l.recent || n <= 0 {
			return nil
		}
		if l.fair != nil {
			return fmt.Errorf("%w: NoteThrottled counts a limit's key; a fair share counts its members as it parks them", ErrMisuse)
		}
		now := ""
		if l.clock != nil {
			now = strconv.FormatInt(l.clock.Now().UnixMicro(), 10)
		}
		return recentScript.Run(ctx, l.calls.rdb, []string{recentKey(redisKey(l.prefix, key))}, now, n).Err()
	case *localLimiter:
		return nil
	}
	return fmt.Errorf("%w: NoteThrottled counts on a limiter of New or NewLocal, got %T", ErrMisuse, lim)
}
