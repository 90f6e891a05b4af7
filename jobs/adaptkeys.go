package jobs

import (
	"context"
	"errors"
	"fmt"
	"math"
	"net/url"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/throttle"
)

// A keyed adaptive quota learns one rate per key value (per destination,
// per customer token): each value has a controller of its own in Redis,
// adapt.lua on a state of its own, and its learned limit is a gate of its
// own in every worker, built on first use as a key value's override is
// (learnedGates), and replaced, not the whole gate set, when the value's
// limit changes. A worker reports only the key values its tasks used since
// its last report, in one pipelined trip, so the cost follows the values in
// use, not all the fleet ever saw; it forgets a value (its learned rate and
// its gate) adaptKeyIdle after its last task, and Redis forgets the value's
// state adaptKeyTTL after the fleet's last report of it. A key value with
// an override (in the file, or set live) keeps it: its rate is not learned.
const (
	// maxAdaptiveKeys bounds the key values of one quota a worker tallies
	// and keeps a learned rate for; past it, a new value books at the
	// quota's starting rate until others are forgotten.
	maxAdaptiveKeys = 10_000
	// adaptKeyTTL is how long a key value's learned rate outlives its last
	// report: long enough for a deploy or a quiet night, short enough that
	// the values of customers gone do not pile up.
	adaptKeyTTL = 24 * time.Hour
	// adaptKeyIdle is how long a worker keeps a key value's learned rate
	// and gate after its last task.
	adaptKeyIdle = time.Minute
	// adaptKeyFirstRead bounds the read of a key value's learned rate the
	// first time a worker meets the value.
	adaptKeyFirstRead = time.Second
	// adaptKeyTakeOver: no turn is booked on a key value's gate at a new
	// learned limit until this long after this worker built it. Its state
	// takes over, at its first booking, what the old gate's counts for the
	// time ahead, the turns booked ahead on it within a bucket's window
	// too; the tasks held for those turns, here and on the other workers
	// (told of the change within milliseconds), give them back first
	// instead, or each would be a turn lost (half a second of calls, at a
	// destination of 2/s).
	adaptKeyTakeOver = 25 * time.Millisecond
)

// adaptKeyKey is the controller state of one key value (as its limit keeps
// it: hashed with hash_keys) of keyed adaptive quota quota, in the value's
// own cluster slot.
func adaptKeyKey(quota, stored string) string { return throttle.Key(adaptKeyPrefix(quota), stored) }

func adaptKeyPrefix(quota string) string { return "sluice:adaptk:" + url.PathEscape(quota) + ":" }

// keyRate is one key value of a keyed adaptive quota in this worker: the
// answers its calls got since the last report, and its learned rate as
// last read.
type keyRate struct {
	tally upstreamTally
	// wanted: a task claimed a turn on the value since the last report, so
	// its rate is read again even if no call was answered.
	wanted atomic.Bool
	// unread: a report passed the value by (no task of it here lately),
	// so its rate as last read may be stale: the next task reads it again.
	unread atomic.Bool
	used   atomic.Int64                // unix µs of the last task, this worker's clock
	rate   atomic.Pointer[LearnedRate] // nil: none read yet
}

// quotaKeys are the key values of one keyed adaptive quota in this worker.
type quotaKeys struct {
	mu   sync.Mutex
	keys map[string]*keyRate // by stored key value; at most maxAdaptiveKeys
	full atomic.Bool         // a value was turned away: logged once per report
}

// keysOf is quota's key values in this worker.
func (a *adaptiveRates) keysOf(quota string) *quotaKeys {
	if v, ok := a.keyed.Load(quota); ok {
		return v.(*quotaKeys)
	}
	v, _ := a.keyed.LoadOrStore(quota, &quotaKeys{keys: map[string]*keyRate{}})
	return v.(*quotaKeys)
}

// keyRateOf is key value stored of quota in this worker, marked used now;
// nil if the worker keeps maxAdaptiveKeys values of the quota already.
// fresh: the worker had not kept it.
func (a *adaptiveRates) keyRateOf(quota, stored string) (kr *keyRate, fresh bool) {
	qk := a.keysOf(quota)
	qk.mu.Lock()
	kr = qk.keys[stored]
	if kr == nil {
		if len(qk.keys) >= a.maxKeys {
			qk.mu.Unlock()
			qk.full.Store(true)
			return nil, false
		}
		kr, fresh = new(keyRate), true
		qk.keys[stored] = kr
	}
	qk.mu.Unlock()
	kr.used.Store(a.clock.Now().UnixMicro())
	return kr, fresh
}

// learnedKey is the learned rate of key value stored of quota name
// for a task that claims a turn on it: as last read, or, the first time
// this worker meets the value, read from Redis now (once per value: a
// worker started later books by the fleet's rate from its first task),
// and so too after the reports passed the value by (unread): a turn booked
// at a limit the fleet has left is one its current state does not count,
// and at a destination allowing one call an interval apart it comes right
// next to one of the fleet's (a 429, and a cut).
// Not ok: none learned yet, or the value is past maxAdaptiveKeys.
func (a *adaptiveRates) learnedKey(name, stored string) (LearnedRate, bool) {
	kr, fresh := a.keyRateOf(name, stored)
	if kr == nil {
		return LearnedRate{}, false
	}
	kr.wanted.Store(true)
	if kr.unread.Swap(false) || fresh {
		ctx, cancel := context.WithTimeout(context.Background(), adaptKeyFirstRead)
		if lr, ok, err := readLearned(ctx, a.rdb, adaptKeyKey(name, stored)); err == nil && ok {
			kr.rate.Store(&lr)
		}
		cancel()
	}
	if lr := kr.rate.Load(); lr != nil {
		return *lr, true
	}
	return LearnedRate{}, false
}

// noteKey adds one answer to the tally of key value stored of quota g.
func (a *adaptiveRates) noteKey(g *gate, stored string, ans UpstreamAnswer) {
	if g.overrides.of(stored, false) != nil {
		return // its override is in force: its answers say nothing of a learned rate
	}
	if kr, _ := a.keyRateOf(g.key, stored); kr != nil {
		kr.tally.add(g.limit, ans)
	}
}

// reportKeys sends the tallies of the key values of keyed adaptive quota l
// (name) that were used since the last report, in one pipelined trip, and
// keeps their rates; it forgets the values idle for adaptKeyIdle. It
// reports whether a rate changed.
func (a *adaptiveRates) reportKeys(ctx context.Context, name string, l LimitConfig, learned *learnedGates) bool {
	qk := a.keysOf(name)
	pinned := a.pinned(name)
	now := a.clock.Now()
	idleSince := now.Add(-a.keyIdle).UnixMicro()
	// A value used within adaptiveReserve may have tasks held here for
	// turns booked on its gate: its rate is read at every report (and at
	// every other worker's change), so that they book again at once when
	// it changes (refresh).
	heldSince := now.Add(-adaptiveReserve).UnixMicro()
	type sent struct {
		stored string
		kr     *keyRate
		cmd    *redis.Cmd
		args   []any
	}
	var batch []sent
	qk.mu.Lock()
	for stored, kr := range qk.keys {
		t := kr.tally.take()
		if !kr.wanted.Swap(false) && t.empty() {
			used := kr.used.Load()
			if used < idleSince {
				delete(qk.keys, stored)
				learned.forget(stored)
				continue
			}
			if used < heldSince || !learned.holds(stored) {
				kr.unread.Store(true)
				continue
			}
		}
		if pinned {
			t = tallied{} // what the pinned limit met says nothing of the learned one
		}
		batch = append(batch, sent{stored: stored, kr: kr, args: adaptArgs(a.clock.scriptNow(), l, t, a.keyTTL)})
	}
	qk.mu.Unlock()
	if qk.full.Swap(false) {
		if d, _ := a.logGate.AllowN(context.Background(), "full:"+name, 1); d.Allowed {
			a.log.Warn("a keyed adaptive quota has more key values in use than a worker keeps learned rates for; the others book at its starting rate", "quota", name, "max", a.maxKeys)
		}
	}
	if len(batch) == 0 {
		return false
	}
	run := func() error {
		_, err := a.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
			for i := range batch {
				batch[i].cmd = adaptScript.EvalSha(ctx, p, []string{adaptKeyKey(name, batch[i].stored)}, batch[i].args...)
			}
			return nil
		})
		return err
	}
	err := run()
	if err != nil && redis.HasErrorPrefix(err, "NOSCRIPT") {
		if err = adaptScript.Load(ctx, a.rdb).Err(); err == nil {
			err = run()
		}
	}
	changed := false
	for _, b := range batch {
		reply, cmdErr := b.cmd.StringSlice()
		if cmdErr != nil {
			err = errors.Join(err, cmdErr)
			continue
		}
		lr, cause, ok := parseAdapt(reply)
		if !ok {
			continue
		}
		b.kr.rate.Store(&lr)
		learned.refresh(b.stored, lr)
		if cause != "" {
			changed = true
			if d, _ := a.logGate.AllowN(context.Background(), "quota:"+name, 1); d.Allowed {
				a.log.Info("adaptive quota: a key value's rate changed", "quota", name, "key", b.stored, "to", round2(lr.Rate),
					"cause", cause, "recent_successes", reply[3], "per", l.Period)
			}
		}
	}
	if err != nil && ctx.Err() == nil {
		if d, _ := a.logGate.AllowN(context.Background(), "redis", 1); d.Allowed {
			a.log.Warn("cannot report to a keyed adaptive quota's controllers; the key values' rates in force stay", "quota", name, "err", err)
		}
	}
	return changed
}

// readLearned reads a learned rate kept at key; not ok if none is.
func readLearned(ctx context.Context, rdb redis.UniversalClient, key string) (LearnedRate, bool, error) {
	v, err := rdb.HMGet(ctx, key, learnedFields...).Result()
	if err != nil {
		return LearnedRate{}, false, err
	}
	lr, ok := learnedFrom(v)
	return lr, ok, nil
}

// learnedFields are the fields of a controller's state (adapt.lua) a
// learned rate is read from: rate, limit in force, its time, ceiling.
var learnedFields = []string{"r", "l", "g", "c"}

// learnedFrom reads HMGET learnedFields of a controller's state; not ok
// if it keeps no rate.
func learnedFrom(v []any) (LearnedRate, bool) {
	if len(v) != len(learnedFields) {
		return LearnedRate{}, false
	}
	r, _ := v[0].(string)
	l, _ := v[1].(string)
	g, _ := v[2].(string)
	c, _ := v[3].(string)
	rate, err1 := strconv.ParseFloat(r, 64)
	limit, err2 := strconv.ParseFloat(l, 64)
	since, err3 := strconv.ParseInt(g, 10, 64)
	if err1 != nil || err2 != nil || err3 != nil {
		return LearnedRate{}, false
	}
	ceiling, _ := strconv.ParseFloat(c, 64) // 0 if none
	return LearnedRate{Rate: rate, Limit: limit, Since: time.UnixMicro(since), Searching: ceiling <= 0}, true
}

// LearnedKeyRates reads the learned rates of up to max key values of
// keyed adaptive quota quota of cfg, by the value as the quota keeps it
// (hashed with hash_keys), found by a scan of the keyspace. It changes
// nothing.
func LearnedKeyRates(ctx context.Context, rdb redis.UniversalClient, cfg Config, quota string, max int) (map[string]LearnedRate, error) {
	l, ok := cfg.Quotas[quota]
	if !ok || l.Adaptive == nil || l.Key == "" {
		return nil, nil
	}
	var stored []string
	err := throttle.ScanKeys(ctx, rdb, adaptKeyPrefix(quota), func(key string) bool {
		stored = append(stored, key)
		return len(stored) < max
	})
	if err != nil {
		return nil, fmt.Errorf("jobs: finding the key values of quota %q with a learned rate: %w", quota, err)
	}
	cmds := make([]*redis.SliceCmd, len(stored))
	_, err = rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		for i, v := range stored {
			cmds[i] = p.HMGet(ctx, adaptKeyKey(quota, v), learnedFields...)
		}
		return nil
	})
	if err != nil && !errors.Is(err, redis.Nil) {
		return nil, fmt.Errorf("jobs: reading the learned rates of quota %q's key values: %w", quota, err)
	}
	rates := map[string]LearnedRate{}
	for i, v := range stored {
		if lr, ok := learnedFrom(cmds[i].Val()); ok {
			rates[v] = lr
		}
	}
	return rates, nil
}

// learnedGates are a keyed adaptive quota's key values at their learned
// limits, in one gate set: each value's gate is built when a task first
// claims a turn on it, and built again, taking over what the old one
// counted, when the value's learned limit changes.
type learnedGates struct {
	rates  *adaptiveRates
	quota  string
	limit  LimitConfig // the quota's
	pinned bool        // a runtime limit sets the quota's own limit: no value's rate is learned
	// build builds the gate of key value stored at learned rate lr in
	// generation, the successor of was (nil: of the quota's gate).
	build func(stored string, lr LearnedRate, generation int64, was *gate) (*gate, error)
	built sync.Map // stored key value -> *gate
}

// of is the gate of key value stored at its learned limit, or nil if it
// has none (none learned yet, or the quota is pinned).
func (lg *learnedGates) of(stored string) *gate {
	if lg == nil || lg.pinned {
		return nil
	}
	lr, ok := lg.rates.learnedKey(lg.quota, stored)
	if !ok || lr.Limit < 1 {
		return nil
	}
	return lg.at(stored, lr)
}

// at is the gate of key value stored at learned rate lr: the one built
// if it is at lr's limit, else a new one, which supersedes it.
func (lg *learnedGates) at(stored string, lr LearnedRate) *gate {
	limit := lr.Limit
	generation := max(lg.limit.generation, lr.Since.UnixMicro())
	var was *gate
	if v, ok := lg.built.Load(stored); ok {
		was = v.(*gate)
		if was.limit.learned == limit && was.limit.generation == generation {
			return was
		}
	}
	g, err := lg.build(stored, lr, generation, was)
	if err != nil {
		return nil // Validate checked the spec at adaptive.min and .max: a bug; the quota's own limit holds
	}
	if was != nil {
		g.takeOverAt = time.Now().Add(adaptKeyTakeOver)
	}
	lg.built.Store(stored, g)
	if was != nil {
		was.supersede() // the tasks held here for its turns book again
	}
	return g
}

// awaitTakeOver waits, before a turn is booked on g, until its state may
// take over from its predecessor's (adaptKeyTakeOver). Real time: the
// other workers' news of the change is.
func (g *gate) awaitTakeOver() {
	if wait := time.Until(g.takeOverAt); !g.takeOverAt.IsZero() && wait > 0 {
		time.Sleep(wait)
	}
}

// refresh puts key value stored's learned rate lr in force at once if
// this worker built a gate for it at another: the tasks held here for
// turns booked on the old gate book again now, not at their old turns,
// which the new gate did not count if they were further ahead than its
// bucket's window when it took over (another worker built it): each would
// come on top of one of the new gate's.
func (lg *learnedGates) refresh(stored string, lr LearnedRate) {
	if lg == nil || lg.pinned || lr.Limit < 1 {
		return
	}
	if _, ok := lg.built.Load(stored); ok {
		lg.at(stored, lr)
	}
}

// holds reports whether this worker built a gate for key value stored:
// tasks here may hold turns booked on it.
func (lg *learnedGates) holds(stored string) bool {
	if lg == nil {
		return false
	}
	_, ok := lg.built.Load(stored)
	return ok
}

// forget drops the gate of key value stored.
func (lg *learnedGates) forget(stored string) {
	if lg != nil {
		lg.built.Delete(stored)
	}
}

// tallied is one report's worth of a tally.
type tallied struct {
	ok, busy int64
	stated   float64
	low      bool
}

func (t tallied) empty() bool { return t.ok == 0 && t.busy == 0 && t.stated == 0 && !t.low }

// take empties t, returning what it held.
func (t *upstreamTally) take() tallied {
	return tallied{ok: t.ok.Swap(0), busy: t.busy.Swap(0), low: t.low.Swap(false), stated: math.Float64frombits(t.stated.Swap(0))}
}

// adaptArgs are adapt.lua's ARGV for one tally of quota l.
func adaptArgs(now string, l LimitConfig, t tallied, ttl time.Duration) []any {
	lowArg := "0"
	if t.low {
		lowArg = "1"
	}
	fine := "0" // a window's limit is whole events per period
	if l.Algorithm == string(throttle.TokenBucket) || l.Algorithm == string(throttle.LeakyBucket) {
		fine = "1"
	}
	return []any{now, l.Adaptive.Min, l.Adaptive.Max, l.startRate(), l.RatePeriod().Microseconds(), t.ok, t.busy,
		strconv.FormatFloat(t.stated, 'f', 6, 64), lowArg, int64(ttl / time.Second), fine, adaptEvery.Microseconds()}
}

// parseAdapt reads adapt.lua's reply: the learned rate, and the cause of
// a change ("" if none).
func parseAdapt(reply []string) (LearnedRate, string, bool) {
	if len(reply) != 7 {
		return LearnedRate{}, "", false
	}
	rate, err1 := strconv.ParseFloat(reply[0], 64)
	limit, err2 := strconv.ParseFloat(reply[4], 64)
	since, err3 := strconv.ParseInt(reply[5], 10, 64)
	ceiling, err4 := strconv.ParseFloat(reply[6], 64)
	if err1 != nil || err2 != nil || err3 != nil || err4 != nil {
		return LearnedRate{}, "", false
	}
	return LearnedRate{Rate: rate, Limit: limit, Since: time.UnixMicro(since), Searching: ceiling <= 0, changed: reply[2] != ""}, reply[2], true
}
