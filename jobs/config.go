package jobs

import (
	"errors"
	"fmt"
	"iter"
	"math"
	"sort"
	"strings"
	"time"

	"github.com/sluicehq/sluice/throttle"
)

// Config is what a worker fleet is told to do: the gates of every queue and
// task type. It comes from config.yaml (see package github.com/sluicehq/sluice/config); this package
// takes it as a plain value.
type Config struct {
	Worker WorkerConfig
	Queues map[string]QueueConfig // by queue name
	Quotas map[string]LimitConfig // by quota name
	Tasks  map[string]TaskConfig  // by task type
	HTTP   HTTPConfig
}

// WorkerConfig tunes one worker process.
type WorkerConfig struct {
	Concurrency int    // tasks run at once by this process; default 10
	MetricsAddr string // Prometheus metrics and the web UI; default 127.0.0.1:2112
	// HoldMax is the longest a task waits for its turn inside the worker
	// (holding one of its slots); a task whose turn is further away goes
	// back to Redis scheduled for it. Default 1s.
	HoldMax time.Duration
	// ReserveMax is the furthest ahead a turn is booked; a task that would
	// wait longer is scheduled to ask again then. Default 1m.
	ReserveMax time.Duration
	// Waiting is how many tasks one worker may hold waiting for their turn
	// besides the Concurrency it runs: a waiting task takes none of the
	// slots that run handlers. A queue may fill at most half of it, so a
	// slow queue cannot keep the others' tasks out. Default: room for the
	// tasks back ahead of their turns at the config's rates, from
	// Concurrency to 10 times it (defaultWaiting).
	Waiting int
	// UI is the web UI (asynqmon) at /ui/ on MetricsAddr; cmd/worker serves it.
	UI WebUIConfig
}

// WebUIConfig says what the web UI lets its users do. The zero value is
// read-only, without a login.
type WebUIConfig struct {
	Writes       bool   // let users delete, run, archive, pause; needs User and PasswordHash
	User         string // the HTTP basic auth user; with PasswordHash, every page needs the login
	PasswordHash string // a bcrypt hash of the password (worker --hash-password makes one)
}

// QueueConfig is one queue's share of the workers and its drain gate.
type QueueConfig struct {
	Priority    int // asynq priority weight; default 1
	Concurrency int // tasks of this queue running at once, fleet-wide; 0: no limit
	// ConcurrencyOnRedisError is what a task does when the concurrency
	// limit cannot be asked: OnRedisErrorWait ("" means it too) or
	// OnRedisErrorAllow.
	ConcurrencyOnRedisError string
	Drain                   *LimitConfig // nil: the queue is not rate-limited
	// Fairness shares the drain among the values of a key (tenants, say)
	// in proportion to their weights; nil: first come, first served.
	Fairness *FairnessConfig
	// Shards splits the queue over this many asynq queues, each in a
	// Redis Cluster slot of its own (see shards.go): 1 (the default) is
	// one asynq queue named as the queue; 2 to 64 lift the ceiling of one
	// master's work. Producers spread the tasks over the shards, workers
	// serve them all, and the drain is shared among the shards that have
	// tasks, its total exactly the configured rate.
	Shards int

	// shardOf, in a config whose sharded queues were replaced by their
	// shards (Config.sharded), is the sharded queue a shard belongs to;
	// "" for a queue that is no shard.
	shardOf string
}

// FairnessConfig shares a queue's drain among the keys that have tasks
// waiting, in proportion to their weights, counting each task's cost: a
// key that needs less than its share leaves the rest to the others
// (max-min fair). See fair.go.
type FairnessConfig struct {
	Key     string         // a CEL expression over the task (see keys.go)
	Weights map[string]int // by key value; 1 when not listed
}

// LimitConfig is one rate limit: a throttle.Spec and what to do when Redis
// cannot be reached.
type LimitConfig struct {
	Algorithm    string
	Limit        int
	Period       time.Duration
	Burst        int
	Windows      int
	OnRedisError string // deny, allow or local
	// MaxBlock bounds how long an upstream's Retry-After may block a quota
	// (quotas only; default 10m): one header must not freeze a task type
	// for years.
	MaxBlock time.Duration
	// Guard (quotas only; 1ms to 10s, at most the period) absorbs the
	// jitter between a booked turn and its request's arrival at the
	// upstream, so that the upstream, counting arrivals, never sees more
	// than its rule: a sliding window is counted over period + guard
	// (default 75ms), a bucket's burst is lowered by the events of guard
	// at its rate (default none: it changes the burst configured). A fixed
	// window counts the upstream's own calendar windows and takes none.
	// See Spec.
	Guard time.Duration
	// Key, if set, is a CEL expression over the task (see keys.go): the
	// limit then holds separately for every value it gives.
	Key string
	// Overrides give some key values a limit of their own: each field set
	// replaces the limit's, the others are inherited.
	Overrides map[string]LimitOverride
	// HashKeys keeps each key value by its hash (see hashedKey), so that
	// the values (API tokens, say) are in no Redis key name, log line,
	// metric or status output. Overrides match all the same, given by
	// value or by hashed name. Keyed limits only.
	HashKeys bool
	// OnKeyError is what a task does whose key expression fails (a missing
	// field, a wrong type): OnKeyErrorDefault ("" means it too) or
	// OnKeyErrorWait. Keyed limits only.
	OnKeyError string
	// Adaptive, if set (quotas only), makes the quota learn its upstream's
	// real limit from the answers of its calls (adapt.go): Limit is then
	// the rate it starts from, and the fleet's learned rate takes its
	// place within [Min, Max].
	Adaptive *AdaptiveConfig

	// filed is an adaptive quota's Limit, Period and Burst as in its file,
	// where a learned limit took their place (atLearned); nil if none did.
	// learned is that learned limit; searching, on a key value's gate at
	// its learned limit, that the value's controller had met no limit yet
	// when the gate was built (its rate still grew by itself:
	// LearnedRate.Searching).
	filed     *filedRate
	learned   float64
	searching bool
	// generation is the µs of the limit's last runtime change (set, reset
	// or lapse), 0 if none: its state's version (stateVersion).
	generation int64
}

// filedRate is an adaptive quota's rate as in its file.
type filedRate struct {
	limit, burst int
	period       time.Duration
}

// What a task does when its key expression fails (on_key_error).
const (
	// OnKeyErrorDefault: it takes the limit's DefaultKey, shared by every
	// task whose key failed, and runs when that key allows.
	OnKeyErrorDefault = "default"
	// OnKeyErrorWait: it waits in Redis, neither run nor failed, and asks
	// again every keyErrorWait (after a reload that fixes the expression,
	// it runs); each time is counted and logged.
	OnKeyErrorWait = "wait"
)

// AdaptiveConfig bounds an adaptive quota's learned rate, in events per
// the quota's period. Both are required.
type AdaptiveConfig struct {
	Min int
	Max int
}

// maxAdaptiveRate bounds adaptive.max: a learned rate is a float kept in
// Redis and rounded to a limit, far below where rounding matters.
const maxAdaptiveRate = 1_000_000

// LimitOverride is one key value's own limit; zero fields are inherited.
type LimitOverride struct {
	Algorithm    string
	Limit        int
	Period       time.Duration
	Burst        int
	Windows      int
	OnRedisError string
}

// override is l for the key value with o: o's fields where set.
func (l LimitConfig) override(o LimitOverride) LimitConfig {
	l = l.replaced(o)
	l.Key, l.Overrides, l.OnKeyError, l.HashKeys = "", nil, "", false
	return l
}

// replaced is l with o's fields where set (a runtime limit's, say), its
// key and overrides kept.
func (l LimitConfig) replaced(o LimitOverride) LimitConfig {
	m := LimitOverride{l.Algorithm, l.Limit, l.Period, l.Burst, l.Windows, l.OnRedisError}.merged(o)
	l.Algorithm, l.Limit, l.Period, l.Burst, l.Windows, l.OnRedisError = m.Algorithm, m.Limit, m.Period, m.Burst, m.Windows, m.OnRedisError
	return l
}

// merged is o with the fields set in over replaced.
func (o LimitOverride) merged(over LimitOverride) LimitOverride {
	if over.Algorithm != "" {
		o.Algorithm = over.Algorithm
	}
	if over.Limit != 0 {
		o.Limit = over.Limit
	}
	if over.Period != 0 {
		o.Period = over.Period
	}
	if over.Burst != 0 {
		o.Burst = over.Burst
	}
	if over.Windows != 0 {
		o.Windows = over.Windows
	}
	if over.OnRedisError != "" {
		o.OnRedisError = over.OnRedisError
	}
	return o
}

// defaultMaxBlock is a quota's MaxBlock unless the config says otherwise.
const defaultMaxBlock = 10 * time.Minute

// defaultGuard is a sliding window quota's Guard unless the config says
// otherwise: requests reached an upstream up to 16ms closer than their
// turns on a quiet 2-core machine, and up to 72ms on the same machine at
// a load of 8 (TestCustomerQuota; see docs/per-customer-quotas.md, "Your provider says N per
// period"). It costs a quota of N per second 7% of its rate.
const defaultGuard = 75 * time.Millisecond

// minGuard and maxGuard bound a quota's guard.
const minGuard, maxGuard = time.Millisecond, 10 * time.Second

// TaskConfig is what a task type draws on.
type TaskConfig struct {
	Quotas      []string // names of Config.Quotas
	Cost        int      // drawn from each quota and from the drain gate; default 1
	Concurrency int      // tasks of this type running at once, fleet-wide; 0: no limit
	// Schema is a JSON Schema file (2020-12) for the type's payloads,
	// relative to the config file. enqueue and its intake refuse a payload
	// it does not allow, before anything is written; the worker does not
	// look at it.
	Schema string
	// ConcurrencyOnRedisError is as for QueueConfig.
	ConcurrencyOnRedisError string
	// ConcurrencyKey, if set, is a CEL expression over the task (see
	// keys.go): Concurrency then holds per value it gives (at most 2
	// running exports per customer), fleet-wide.
	ConcurrencyKey string
}

// HTTPConfig limits the http:request job type.
type HTTPConfig struct {
	Allow []string // what it may call: see AllowList
}

// The failure policies of a gate whose Redis cannot be reached: package
// throttle's, named here for config.yaml's on_redis_error.
const (
	OnRedisErrorDeny  = throttle.OnRedisErrorDeny  // the task waits in Redis: safest for quotas that cost money
	OnRedisErrorAllow = throttle.OnRedisErrorAllow // the task runs: availability first
	OnRedisErrorLocal = throttle.OnRedisErrorLocal // an in-process limiter at the limit divided by the live workers
)

// maxMaxBlock bounds quotas.<name>.max_block.
const maxMaxBlock = 24 * time.Hour

// maxReserve bounds worker.reserve_max: a turn further ahead than a day is
// a mistake, and the limiters do not book one (throttle's horizon).
const maxReserve = 24 * time.Hour

// maxWaiting bounds worker.waiting: each waiting task is a goroutine and an
// active task in asynq's lists.
const maxWaiting = 10_000

// OnRedisErrorWait is the default failure policy of a concurrency limit
// (concurrency_on_redis_error): the task goes back to Redis and asks again
// a second later, neither run nor held in a slot. The other is
// OnRedisErrorAllow: the task runs without the limit. A concurrency limit
// has no local policy: its share for each worker would need the count of
// the workers serving the queue, and a limit below that count would have
// a share of zero.
const OnRedisErrorWait = "wait"

// Defaults returns c with every unset value at its default.
func (c Config) Defaults() Config {
	if c.Worker.Concurrency == 0 {
		c.Worker.Concurrency = 10
	}
	if c.Worker.MetricsAddr == "" {
		c.Worker.MetricsAddr = "127.0.0.1:2112"
	}
	if c.Worker.HoldMax == 0 {
		c.Worker.HoldMax = time.Second
	}
	if c.Worker.ReserveMax == 0 {
		c.Worker.ReserveMax = time.Minute
	}
	queues := make(map[string]QueueConfig, len(c.Queues))
	for name, q := range c.Queues {
		if q.Priority == 0 {
			q.Priority = 1
		}
		if q.Shards == 0 {
			q.Shards = 1
		}
		if q.Drain != nil {
			d := q.Drain.defaults(throttle.LeakyBucket)
			q.Drain = &d
		}
		queues[name] = q
	}
	c.Queues = queues
	quotas := make(map[string]LimitConfig, len(c.Quotas))
	for name, l := range c.Quotas {
		l = l.defaults(throttle.TokenBucket)
		if l.MaxBlock == 0 {
			l.MaxBlock = defaultMaxBlock
		}
		if l.Guard == 0 && (l.Algorithm == string(throttle.SlidingLog) || l.Algorithm == string(throttle.SlidingCounter)) {
			l.Guard = defaultGuard
		}
		quotas[name] = l
	}
	c.Quotas = quotas
	tasks := make(map[string]TaskConfig, len(c.Tasks))
	for name, t := range c.Tasks {
		if t.Cost == 0 {
			t.Cost = 1
		}
		tasks[name] = t
	}
	c.Tasks = tasks
	if c.Worker.Waiting == 0 {
		c.Worker.Waiting = defaultWaiting(c)
	}
	return c
}

// defaultWaiting is worker.waiting unless the config sets it: room for the
// tasks that come back ahead of their turns at the config's rates, at
// least worker.concurrency and at most 10 times it. The waker brings a
// task back up to alwaysHold before its turn, and the worker holds it in
// one of asynq's slots until then: at 300/s, 120 tasks at any moment. With
// the room of 10 slots of before, a fleet of 3 drained such a queue at 265
// to 290/s (TestShardedQueue): tasks back for their turns waited in
// pending for a free slot, and some came after their turns. The rate is
// the queues' drains' where every queue has one (a quota only lowers
// it), else the quotas' too; keyed limits count for nothing (their total
// is unknown), and a limit raised live keeps the room the worker started
// with.
func defaultWaiting(c Config) int {
	perSecond, undrained := 0.0, false
	for _, q := range c.Queues {
		if q.Drain == nil {
			undrained = true
			continue
		}
		perSecond += q.Drain.unkeyedRate()
	}
	if undrained || len(c.Queues) == 0 {
		for _, l := range c.Quotas {
			perSecond += l.unkeyedRate()
		}
	}
	// Bounded before the conversion: a rate of 10^9 a nanosecond is valid.
	woken := int(math.Min(math.Ceil(perSecond*alwaysHold.Seconds()), maxWaiting))
	// (At least 1: a concurrency below 1 is reported as such alone.)
	return max(1, min(max(c.Worker.Concurrency, woken), 10*c.Worker.Concurrency, maxWaiting))
}

// unkeyedRate is l's rate in events a second, 0 for a keyed limit.
func (l LimitConfig) unkeyedRate() float64 {
	if l.Key != "" || l.Limit <= 0 || l.Period <= 0 {
		return 0
	}
	return float64(l.Limit) / l.Period.Seconds()
}

func (l LimitConfig) defaults(algorithm throttle.Algorithm) LimitConfig {
	if l.Algorithm == "" {
		l.Algorithm = string(algorithm)
	}
	if l.OnRedisError == "" {
		l.OnRedisError = OnRedisErrorDeny
	}
	return l
}

// Spec is the limit as a throttle.Spec, its guard applied: what sluice
// books is stricter than the upstream's rule by the jitter of guard
// between a turn and its request's arrival. A sliding window counts over
// period + guard. A bucket's burst is lowered by the events of guard at
// its rate, ceil(limit·guard/period), but never below 1: a request up to
// guard late falls in an interval up to guard shorter, where burst +
// rate·(T + guard) is at most the upstream's burst + rate·T. A fixed
// window is the upstream's calendar window and is left as it is.
func (l LimitConfig) Spec() throttle.Spec {
	spec := throttle.Spec{Algorithm: throttle.Algorithm(l.Algorithm), Limit: l.Limit, Period: l.Period, Burst: l.Burst, Windows: l.Windows}
	if l.Guard <= 0 || l.Limit <= 0 || l.Period <= 0 {
		return spec
	}
	switch spec.Algorithm {
	case throttle.SlidingLog, throttle.SlidingCounter:
		spec.Period += l.Guard
	case throttle.TokenBucket, throttle.LeakyBucket:
		events := int((int64(l.Limit)*int64(l.Guard) + int64(l.Period) - 1) / int64(l.Period))
		spec.Burst = max(min(spec.Burst, 1), spec.Burst-events)
	}
	return spec
}

// ConfigProblem is one problem Config.Validate finds, at a key.
type ConfigProblem struct {
	Key     string // as config.yaml spells it: queues.emails.drain.limit
	Problem string // what is wrong: "must be > 0, got 0"
}

func (p *ConfigProblem) Error() string { return p.Key + ": " + p.Problem }

// configProblem is shorthand for a *ConfigProblem with a formatted Problem.
func configProblem(key, format string, args ...any) error {
	return &ConfigProblem{Key: key, Problem: fmt.Sprintf(format, args...)}
}

// Validate returns one error per problem in c (after Defaults), each a
// *ConfigProblem naming its key as config.yaml spells it, in a stable order.
func (c Config) Validate() []error {
	var errs []error
	bad := func(key, format string, args ...any) {
		errs = append(errs, configProblem(key, format, args...))
	}
	if c.Worker.Concurrency < 1 {
		bad("worker.concurrency", "must be >= 1, got %d", c.Worker.Concurrency)
	}
	if c.Worker.HoldMax < 0 || c.Worker.HoldMax > maxHoldMax {
		// A task waiting for its next concurrency slot keeps renewing those
		// it took; a wait of a lease or more would hold them idle that long.
		bad("worker.hold_max", "must be from 0 to %v (a third of the %v lease of a concurrency slot), got %v", maxHoldMax, slotLease, c.Worker.HoldMax)
	}
	if c.Worker.ReserveMax < c.Worker.HoldMax {
		bad("worker.reserve_max", "must be >= worker.hold_max (%v), got %v", c.Worker.HoldMax, c.Worker.ReserveMax)
	}
	if c.Worker.ReserveMax > maxReserve {
		bad("worker.reserve_max", "must be at most %v, got %v", maxReserve, c.Worker.ReserveMax)
	}
	if c.Worker.Waiting < 1 || c.Worker.Waiting > maxWaiting {
		bad("worker.waiting", "must be between 1 and %d (0 means room for the rates in the file: see docs/worker.md), got %d", maxWaiting, c.Worker.Waiting)
	}
	if _, err := ParseAllowList(c.HTTP.Allow); err != nil {
		errs = append(errs, err)
	}
	// asynq refuses empty task types and queue names; and "" stands for
	// every task type the config does not name (see gateSet.routeOf).
	if _, ok := c.Queues[""]; ok {
		bad(`queues.""`, "a queue's name must not be empty")
	}
	if _, ok := c.Quotas[""]; ok {
		bad(`quotas.""`, "a quota's name must not be empty")
	}
	if _, ok := c.Tasks[""]; ok {
		bad(`tasks.""`, "a task type must not be empty")
	}
	for _, name := range sortedKeys(c.Queues) {
		q := c.Queues[name]
		key := "queues." + name
		if q.Priority < 1 {
			bad(key+".priority", "must be >= 1, got %d", q.Priority)
		}
		if q.Concurrency < 0 {
			bad(key+".concurrency", "must be >= 0 (0: no limit), got %d", q.Concurrency)
		}
		errs = append(errs, validateSlotPolicy(key, q.ConcurrencyOnRedisError)...)
		errs = append(errs, q.validateShards(key, name)...)
		if q.Drain != nil {
			errs = append(errs, q.Drain.validate(key+".drain")...)
			if q.Drain.Adaptive != nil {
				bad(key+".drain.adaptive", "applies to quotas only: a drain is sluice's own pace, an upstream's answers say nothing of it")
			}
			if q.Drain.MaxBlock != 0 {
				bad(key+".drain.max_block", "applies to quotas only: an upstream's Retry-After blocks the quotas of the task's type, never a queue's drain")
			}
			if q.Drain.Guard != 0 {
				bad(key+".drain.guard", "applies to quotas only: a guard keeps an upstream's rule as the upstream sees it; a drain is sluice's own pace")
			}
		}
		if f := q.Fairness; f != nil {
			if q.Drain == nil {
				bad(key+".fairness", "shares the queue's drain among keys, but the queue has no drain; give it one (queues.%s.drain)", name)
			} else if q.Drain.Key != "" {
				bad(key+".fairness", "cannot share a keyed drain (queues.%s.drain.key): each key has a drain of its own already", name)
			}
			errs = append(errs, validateKeyExpr(key+".fairness.key", f.Key, true)...)
			if len(f.Weights) > maxWeights {
				bad(key+".fairness.weights", "at most %d are allowed, got %d", maxWeights, len(f.Weights))
			}
			for _, v := range sortedKeys(f.Weights) {
				if len(v) > maxKeyName {
					bad(key+".fairness.weights", "a key value is at most %d bytes, got %d (%.20q...)", maxKeyName, len(v), v)
				}
				if w := f.Weights[v]; w < 1 || w > maxWeight {
					bad(key+".fairness.weights."+v, "must be between 1 and %d, got %d", maxWeight, w)
				}
			}
		}
	}
	for _, name := range sortedKeys(c.Quotas) {
		errs = append(errs, c.Quotas[name].validate("quotas."+name)...)
		if mb := c.Quotas[name].MaxBlock; mb < time.Second || mb > maxMaxBlock {
			bad("quotas."+name+".max_block", "must be between 1s and %v, got %v", maxMaxBlock, mb)
		}
		errs = append(errs, c.Quotas[name].validateAdaptive("quotas."+name+".adaptive")...)
		switch l := c.Quotas[name]; {
		case l.Guard != 0 && l.Algorithm == string(throttle.FixedWindow):
			bad("quotas."+name+".guard", "a fixed_window counts the upstream's own calendar windows, which a guard cannot widen; for an upstream that counts any sliding period use sliding_log")
		case l.Guard != 0 && (l.Guard < minGuard || l.Guard > maxGuard || l.Period > 0 && l.Guard > l.Period):
			bad("quotas."+name+".guard", "must be between %v and %v, and at most the period (%v), got %v", minGuard, maxGuard, l.Period, l.Guard)
		}
	}
	for _, name := range sortedKeys(c.Tasks) {
		t := c.Tasks[name]
		key := "tasks." + name
		for _, quota := range t.Quotas {
			if _, ok := c.Quotas[quota]; !ok {
				bad(key+".quotas", "names quota %q, which is not under quotas (known: %v)", quota, sortedKeys(c.Quotas))
			}
		}
		if t.Cost < 1 {
			bad(key+".cost", "must be >= 1, got %d", t.Cost)
		}
		// A task that costs more than a gate (or one key value's override
		// of it) can ever admit at once would wait forever.
		admits := func(path string, l LimitConfig, why string) {
			for at, spec := range l.specs(path) {
				if t.Cost > spec.Capacity() && spec.Validate() == nil {
					bad(key+".cost", "%d is more than %s can ever admit at once (%d)%s; lower the cost or raise its burst", t.Cost, at, spec.Capacity(), why)
				}
			}
		}
		for _, quota := range t.Quotas {
			if l, ok := c.Quotas[quota]; ok {
				admits("quotas."+quota, l, "")
			}
		}
		for _, queue := range sortedKeys(c.Queues) {
			if d := c.Queues[queue].Drain; d != nil {
				admits("queues."+queue+".drain", *d, ", and a task may be enqueued into any queue")
			}
		}
		if t.Concurrency < 0 {
			bad(key+".concurrency", "must be >= 0 (0: no limit), got %d", t.Concurrency)
		}
		if t.ConcurrencyKey != "" {
			errs = append(errs, validateKeyExpr(key+".concurrency_key", t.ConcurrencyKey, true)...)
			if t.Concurrency == 0 {
				bad(key+".concurrency_key", "needs %s.concurrency: it is the limit that holds per key", key)
			}
		}
		errs = append(errs, validateSlotPolicy(key, t.ConcurrencyOnRedisError)...)
	}
	return errs
}

// maxHoldMax bounds worker.hold_max.
const maxHoldMax = slotLease / 3

func validateSlotPolicy(key, policy string) []error {
	switch policy {
	case "", OnRedisErrorWait, OnRedisErrorAllow:
		return nil
	}
	return []error{configProblem(key+".concurrency_on_redis_error", "must be wait (the default) or allow, got %q", policy)}
}

// slotPolicy is a concurrency_on_redis_error with its default applied.
func slotPolicy(policy string) string {
	if policy == "" {
		return OnRedisErrorWait
	}
	return policy
}

// validateAdaptive checks a quota's adaptive bounds, at key.
func (l LimitConfig) validateAdaptive(key string) []error {
	a := l.Adaptive
	if a == nil {
		return nil
	}
	var errs []error
	bad := func(key, format string, args ...any) {
		errs = append(errs, configProblem(key, format, args...))
	}
	switch {
	case a.Min < 1 || a.Min > maxAdaptiveRate:
		bad(key+".min", "must be between 1 and %d, got %d", maxAdaptiveRate, a.Min)
	case a.Max < a.Min || a.Max > maxAdaptiveRate:
		bad(key+".max", "must be between min (%d) and %d, got %d", a.Min, maxAdaptiveRate, a.Max)
	case l.Limit < a.Min || l.Limit > a.Max:
		bad(strings.TrimSuffix(key, ".adaptive")+".limit", "is the adaptive quota's starting rate: it must be between adaptive.min (%d) and adaptive.max (%d), got %d", a.Min, a.Max, l.Limit)
	}
	if len(errs) == 0 {
		for _, rate := range []int{a.Min, a.Max} {
			at := l
			at.Limit = rate
			if err := at.Spec().Validate(); err != nil {
				bad(key, "the quota is not a valid limit at rate %d: %v", rate, err)
			}
		}
	}
	return errs
}

func (l LimitConfig) validate(key string) []error {
	var errs []error
	switch l.OnRedisError {
	case OnRedisErrorDeny, OnRedisErrorAllow, OnRedisErrorLocal:
	default:
		errs = append(errs, configProblem(key+".on_redis_error", "must be deny, allow or local, got %q", l.OnRedisError))
	}
	if err := l.Spec().Validate(); err != nil {
		var bad *throttle.SpecError
		if errors.As(err, &bad) {
			// Name the key as config.yaml spells it.
			return append(errs, configProblem(key+"."+strings.ToLower(bad.Field), "%s", bad.Problem))
		}
		errs = append(errs, configProblem(key, "%v", err))
	}
	errs = append(errs, validateKeyExpr(key+".key", l.Key, false)...)
	switch {
	case l.OnKeyError != "" && l.OnKeyError != OnKeyErrorDefault && l.OnKeyError != OnKeyErrorWait:
		errs = append(errs, configProblem(key+".on_key_error", "must be default or wait, got %q", l.OnKeyError))
	case l.OnKeyError != "" && l.Key == "":
		errs = append(errs, configProblem(key+".on_key_error", "applies to a keyed limit, but the limit has no key; give it one (%s.key)", key))
	}
	if l.HashKeys && l.Key == "" {
		errs = append(errs, configProblem(key+".hash_keys", "applies to a keyed limit, but the limit has no key; give it one (%s.key)", key))
	}
	if len(l.Overrides) > 0 && l.Key == "" {
		errs = append(errs, configProblem(key+".overrides", "apply to key values, but the limit has no key; give it one (%s.key)", key))
	}
	if len(l.Overrides) > maxKeyOverrides {
		errs = append(errs, configProblem(key+".overrides", "at most %d are allowed, got %d", maxKeyOverrides, len(l.Overrides)))
	}
	for _, v := range sortedKeys(l.Overrides) {
		if len(v) > maxKeyName {
			errs = append(errs, configProblem(key+".overrides", "a key value is at most %d bytes, got %d (%.20q...)", maxKeyName, len(v), v))
			continue
		}
		errs = append(errs, l.override(l.Overrides[v]).validate(key+".overrides."+v)...)
	}
	return errs
}

// specs yields the limit's spec and each override's, by the key
// config.yaml names it under (key, key.overrides.<value>).
func (l LimitConfig) specs(key string) iter.Seq2[string, throttle.Spec] {
	return func(yield func(string, throttle.Spec) bool) {
		if !yield(key, l.Spec()) {
			return
		}
		for _, v := range sortedKeys(l.Overrides) {
			if !yield(key+".overrides."+v, l.override(l.Overrides[v]).Spec()) {
				return
			}
		}
	}
}

// validateKeyExpr checks a key expression: it must compile and type-check
// (the problem names where in it), or be empty unless required.
func validateKeyExpr(key, source string, required bool) []error {
	if source == "" && !required {
		return nil
	}
	if _, err := compileKey(source); err != nil {
		return []error{configProblem(key, "%v", err)}
	}
	return nil
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}
