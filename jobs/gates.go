package jobs

import (
	"context"
	"fmt"
	"hash/fnv"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/throttle"
)

// gateSet is one config's gates, built once per config and swapped whole on
// reload.
type gateSet struct {
	cfg      Config
	drains   map[string]*gate // by queue
	quotas   map[string]*gate // by quota name
	queueSem map[string]*throttle.Semaphore
	typeSem  map[string]*throttle.Semaphore
	typeKey  map[string]*keyExpr  // concurrency_key, by task type
	fair     map[string]*fairGate // by queue
	clock    throttle.Clock       // the pools' clock: a test's, or nil for the system's
	replaced chan struct{}        // closed when a config with other limits replaces this one
	held     *heldTurns           // tasks holding turns of these gates in this worker
	pools    sync.Map             // gate tags and cost -> *throttle.Pool, nil if the gates cannot lend
	// evaluations counts the pools' script runs per gate (nil: not).
	evaluations *prometheus.CounterVec
	// keyedPools are the pools of sets of gates with a keyed one: per key
	// values too, so bounded.
	keyedPools *keyedPools
	// routes are what tasks meet, by queue and configured type (type ""
	// for every other type), worked out once: see routeOf.
	routes map[routeKey]*route
}

// route is what every task of one queue and type meets, in order: its
// queue's drain gate, then its type's quotas, then the concurrency limits.
// It is worked out once per config, so that a task whose turns are lent
// costs a map lookup and a Pool.Take, nothing per gate.
type route struct {
	gates  []*gate // the drain gate first, then the quotas
	quotas []*gate // gates without the drain
	cost   int
	// keyed: a gate is keyed, so each task's claims depend on the task.
	keyed bool
	// claims and pool, if not keyed: every task's claims, and the pool that
	// lends their turns (nil if they cannot).
	claims []claim
	pool   *throttle.Pool
	// fair: the queue shares its drain fairly, counted task by task, so
	// turns are never lent.
	fair bool
	// slots: the task takes a concurrency slot (of its queue or its type).
	slots bool
	// adaptive: a quota is adaptive, so turns are booked at most
	// adaptiveReserve ahead.
	adaptive bool
	// learns: a keyed quota is adaptive, so its key values' limits change
	// often, each to a gate of its own (learnedGates): turns are not lent,
	// as a pool's lease of an old limit would keep turns the new one
	// counts as taken.
	learns bool
}

type routeKey struct{ queue, typ string }

// routeOf returns the route of a task of typ in queue.
func (gs *gateSet) routeOf(queue, typ string) *route {
	if _, ok := gs.cfg.Tasks[typ]; !ok {
		typ = ""
	}
	if r := gs.routes[routeKey{queue, typ}]; r != nil {
		return r
	}
	// A queue the config does not name (asynq serves only those that it
	// does: a test's, or a program's own server): worked out each time.
	return gs.newRoute(queue, typ)
}

func (gs *gateSet) newRoute(queue, typ string) *route {
	r := &route{quotas: gs.quotasOf(typ), cost: gs.cost(typ), fair: gs.fair[queue] != nil,
		slots: gs.queueSem[queue] != nil || gs.typeSem[typ] != nil}
	if g := gs.drains[queue]; g != nil {
		r.gates = append(r.gates, g)
	}
	r.gates = append(r.gates, r.quotas...)
	for _, g := range r.gates {
		r.keyed = r.keyed || g.expr != nil
		r.adaptive = r.adaptive || g.limit.Adaptive != nil
		r.learns = r.learns || g.limit.Adaptive != nil && g.expr != nil
	}
	if !r.keyed && len(r.gates) > 0 {
		for _, g := range r.gates {
			r.claims = append(r.claims, claim{g: g, lim: g.lim, key: g.key})
		}
		if !r.fair {
			r.pool = gs.poolOf(r.claims, r.cost)
		}
	}
	return r
}

// gate is one rate limit: a limiter on Redis that applies its own failure
// policy (throttle.WithOnRedisError).
type gate struct {
	name  string // metric label: "drain:<queue>" or "quota:<name>"
	tag   string // what a task's turns are kept under: name@version
	key   string // the limiter key: the queue or quota name (unkeyed)
	limit LimitConfig
	lim   throttle.Reserver
	// expr, if not nil, makes the gate keyed: the limiter key is the
	// task's key value, under a prefix of the gate's own.
	expr *keyExpr
	// overrides are the key values with a limit of their own (keyed),
	// their gates built on first use; nil if there are none.
	overrides *overrideGates
	// learned are the key values at their learned limits, if the gate is a
	// keyed adaptive quota's (adaptkeys.go); nil otherwise.
	learned *learnedGates
	// superseded, on a key value's gate at its learned limit, is closed
	// when the value's limit changed to another gate (supersede): the tasks
	// held here for turns booked on it book again. nil on other gates.
	superseded chan struct{}
	supersede  func()
	// takeOverAt, on a key value's gate at a new learned limit, is the
	// earliest a turn is booked on it (awaitTakeOver); zero on others.
	takeOverAt time.Time
	// fair: the gate is a queue's fair share (fairGate.share): it has no
	// limit of its own, and its claim is booked and counted with the
	// drain's.
	fair bool
}

// claim is a gate's limiter and key for one task.
type claim struct {
	g   *gate
	lim throttle.Reserver
	key string
}

// gateOptions are what every gate's limiter is built with besides its
// spec: the clock of tests, how many workers share a limit (for the
// local policy), and the lease of concurrency slots.
type gateOptions struct {
	clock   throttle.Clock // nil: Redis's
	workers func() int     // 0: not known yet, and the local policy denies
	lease   time.Duration
	// evaluations, if set, counts the script runs of the gates' pools (as
	// the Scheduler counts those of its bookings).
	evaluations *prometheus.CounterVec
	// previous, if not nil, is the gate set these gates replace (a live
	// change): a changed limit takes over what its predecessor counted.
	previous *gateSet
	// local builds the rate gates on in-process limiters on clock, and no
	// fair shares: a plan's (plan.go), which touches no state in Redis.
	local bool
	// adapt, if set, keeps the learned rates of keyed adaptive quotas'
	// key values (a Scheduler's); pinned reports whether a runtime limit
	// sets a quota's own limit now.
	adapt  *adaptiveRates
	pinned func(quota string) bool
	// replacing, if set, is the gate the one built takes over from (a key
	// value's learned limit changed), instead of its predecessor in
	// previous.
	replacing *gate
	// busy says which shards of each sharded queue have tasks, and so
	// their shares of its drain (shards.go); nil: equal shares.
	busy map[string][]bool
}

func newGateSet(rdb redis.UniversalClient, cfg Config, o gateOptions) (*gateSet, error) {
	cfg = cfg.sharded(o.busy)
	gs := &gateSet{cfg: cfg, drains: map[string]*gate{}, quotas: map[string]*gate{},
		queueSem: map[string]*throttle.Semaphore{}, typeSem: map[string]*throttle.Semaphore{},
		typeKey: map[string]*keyExpr{}, fair: map[string]*fairGate{},
		clock: o.clock, replaced: make(chan struct{}), held: newHeldTurns(), keyedPools: newKeyedPools(maxKeyedPools), evaluations: o.evaluations}
	var newGateWith func(o gateOptions, kind GateKind, name string, l LimitConfig, keyed string) (*gate, error)
	newGate := func(kind GateKind, name string, l LimitConfig, keyed string) (*gate, error) {
		return newGateWith(o, kind, name, l, keyed)
	}
	newGateWith = func(o gateOptions, kind GateKind, name string, l LimitConfig, keyed string) (*gate, error) {
		// A changed limit has a state of its own under a new version: the
		// old state holds turns booked at the old rate, which would keep the
		// queue at that rate until they are all used. Turns booked under an
		// old version are booked again. What the old limit counted up to
		// the change is taken over, key by key (throttle.Replacing): a raise
		// grants no unearned burst, a cut lets nothing through above it.
		spec := l.Spec()
		version := l.stateVersion()
		prefix := limitPrefix(string(kind), version)
		if keyed == "" && l.Key != "" {
			keyed = name
		}
		if keyed != "" {
			// Every key value of the gate under a prefix of its own: the
			// value is the limiter key, so each has its own hash tag
			// (throttle.Key), spread over the cluster's slots.
			prefix += "k:" + url.PathEscape(keyed) + ":"
		}
		opts := []throttle.Option{
			throttle.WithPrefix(prefix),
			throttle.WithOnRedisError(l.OnRedisError, o.workers),
		}
		if keyed != "" {
			// For enqueue status --keys (KeyLoads): counted in each key's
			// slot by the script that throttles.
			opts = append(opts, throttle.WithRecentThrottles())
		}
		if o.clock != nil {
			opts = append(opts, throttle.WithClock(o.clock))
		}
		was := o.replacing
		if was == nil {
			was = o.previous.predecessor(kind, name, keyed)
		}
		if was != nil && was.limit.stateVersion() != version && was.limit.Algorithm == l.Algorithm {
			opts = append(opts, throttle.Replacing(was.lim))
		}
		var lim throttle.Reserver
		var err error
		if o.local {
			lim, err = throttle.NewLocal(spec, throttle.WithClock(o.clock))
		} else {
			lim, err = throttle.New(rdb, spec, opts...)
		}
		if err != nil {
			return nil, fmt.Errorf("jobs: %s %q: %w", kind, name, err)
		}
		label := GateName{kind, name}.String()
		g := &gate{name: label, tag: label + "@" + version, key: name, limit: l, lim: lim}
		if l.Key == "" {
			return g, nil
		}
		if g.expr, err = compileKey(l.Key); err != nil {
			return nil, fmt.Errorf("jobs: %s %q: key: %w", kind, name, err)
		}
		if l.Adaptive != nil && o.adapt != nil && !o.local {
			g.learned = &learnedGates{rates: o.adapt, quota: name, limit: l, pinned: o.pinned != nil && o.pinned(name)}
			g.learned.build = func(stored string, lr LearnedRate, generation int64, was *gate) (*gate, error) {
				o := o
				o.previous, o.replacing = nil, was
				if was == nil {
					o.replacing = g
				}
				at := l.atLearned(lr.Limit).override(LimitOverride{})
				at.generation, at.searching = generation, lr.Searching
				lg, err := newGateWith(o, kind, name, at, name+"\x00"+stored)
				if err != nil {
					return nil, err
				}
				// Named and keyed as the quota's gate (metrics, pools), its
				// key value the limiter key.
				lg.name, lg.key, lg.expr = g.name, stored, g.expr
				superseded := make(chan struct{})
				lg.superseded, lg.supersede = superseded, sync.OnceFunc(func() { close(superseded) })
				return lg, nil
			}
		}
		if len(l.Overrides) > 0 {
			g.overrides = &overrideGates{limits: map[string]LimitOverride{}}
			g.overrides.previous.Store(o.previous)
			var sum uint64 // of every override's hash: its order does not count
			for v, ov := range l.Overrides {
				// Under its stored key: with hash_keys, its value is in no
				// Redis key name.
				stored := l.storedKey(v)
				g.overrides.limits[stored] = ov
				h := fnv.New64a()
				fmt.Fprintf(h, "%s\x00%s\x00%d\x00%d\x00%d\x00%d\x00%s", stored, ov.Algorithm, ov.Limit, ov.Period, ov.Burst, ov.Windows, ov.OnRedisError)
				sum += h.Sum64()
			}
			g.overrides.build = func(stored string, previous *gateSet) (*gate, error) {
				o := o
				o.previous = previous
				ov, err := newGateWith(o, kind, name, l.override(g.overrides.limits[stored]), name+"\x00"+stored)
				if err != nil {
					return nil, err
				}
				ov.name, ov.key = g.name, stored
				return ov, nil
			}
			g.tag += fmt.Sprintf("#%016x", sum)
		}
		return g, nil
	}
	newSem := func(limit int, prefix string, keyed bool) (*throttle.Semaphore, error) {
		opts := []throttle.Option{throttle.WithPrefix(prefix)}
		if keyed {
			opts = append(opts, throttle.WithRecentThrottles())
		}
		if o.clock != nil {
			opts = append(opts, throttle.WithClock(o.clock))
		}
		return throttle.NewSemaphore(rdb, limit, o.lease, opts...)
	}
	for name, q := range cfg.Queues {
		if q.Drain != nil {
			g, err := newGate(DrainGate, name, *q.Drain, "")
			if err != nil {
				return nil, err
			}
			gs.drains[name] = g
			if q.Fairness != nil && !o.local {
				f, err := newFairGate(rdb, name, *q.Drain, *q.Fairness, o.clock)
				if err != nil {
					return nil, err
				}
				gs.fair[name] = f
			}
		}
		if q.Concurrency > 0 {
			sem, err := newSem(q.Concurrency, queueSlotsPrefix, false)
			if err != nil {
				return nil, err
			}
			gs.queueSem[name] = sem
		}
	}
	for name, l := range cfg.Quotas {
		g, err := newGate(QuotaGate, name, l, "")
		if err != nil {
			return nil, err
		}
		gs.quotas[name] = g
	}
	for name, t := range cfg.Tasks {
		if t.Concurrency > 0 {
			sem, err := newSem(t.Concurrency, typeSlotsPrefix(name, t.ConcurrencyKey != ""), t.ConcurrencyKey != "")
			if err != nil {
				return nil, err
			}
			gs.typeSem[name] = sem
		}
		if t.ConcurrencyKey != "" {
			k, err := compileKey(t.ConcurrencyKey)
			if err != nil {
				return nil, fmt.Errorf("jobs: tasks %q: concurrency_key: %w", name, err)
			}
			gs.typeKey[name] = k
		}
	}
	gs.routes = map[routeKey]*route{}
	for queue := range cfg.Queues {
		gs.routes[routeKey{queue, ""}] = gs.newRoute(queue, "")
		for typ := range cfg.Tasks {
			gs.routes[routeKey{queue, typ}] = gs.newRoute(queue, typ)
		}
	}
	return gs, nil
}

// predecessor is the gate of gs (nil: none) that a gate of kind and name
// (keyed: its override's "<name>\x00<value>", or "") replaces: a value's
// override replaces the value's override, or the default limit it had.
func (gs *gateSet) predecessor(kind GateKind, name, keyed string) *gate {
	if gs == nil {
		return nil
	}
	gates := gs.quotas
	if kind == DrainGate {
		gates = gs.drains
	}
	quota, value, override := strings.Cut(keyed, "\x00")
	if !override {
		return gates[name]
	}
	g := gates[quota]
	if g == nil {
		return nil
	}
	if ov := g.overrides.of(value, false); ov != nil {
		return ov
	}
	return g
}

// overrideGates are a keyed gate's overrides, the gate of each key value
// built on first use: a fleet may have 100,000 of them (enqueue limits
// import), and a gate is a limiter of its own (about 500 B), but only the
// values that have tasks need one.
type overrideGates struct {
	limits map[string]LimitOverride // by stored key value
	// build builds the gate of a key value; with previous, as the
	// successor of its gate there (throttle.Replacing).
	build func(stored string, previous *gateSet) (*gate, error)
	// previous is the gate set this one replaced, until this one is
	// replaced in turn (see forget): a gate built later takes over what
	// its predecessor counted, and no chain of gate sets is kept.
	previous atomic.Pointer[gateSet]
	built    sync.Map // stored key value -> *gate
}

// of is the gate of key value stored, or nil if it has no override (or o
// is nil). With successor false, the gate is built without a predecessor:
// it is wanted as a predecessor itself.
func (o *overrideGates) of(stored string, successor bool) *gate {
	if o == nil {
		return nil
	}
	if g, ok := o.built.Load(stored); ok {
		return g.(*gate)
	}
	if _, ok := o.limits[stored]; !ok {
		return nil
	}
	var previous *gateSet
	if successor {
		previous = o.previous.Load()
	}
	g, err := o.build(stored, previous)
	if err != nil {
		// Config.Validate checked every override's spec, and a spec it
		// accepts builds: this is a bug, and the gate's own limit holds.
		return nil
	}
	actual, _ := o.built.LoadOrStore(stored, g)
	return actual.(*gate)
}

// all is every override's gate, each built.
func (o *overrideGates) all() []*gate {
	if o == nil {
		return nil
	}
	gates := make([]*gate, 0, len(o.limits))
	for stored := range o.limits {
		if g := o.of(stored, true); g != nil {
			gates = append(gates, g)
		}
	}
	return gates
}

// stateLayout changes when the layout of the limiters' state in Redis does,
// so that a new version never reads an old one's.
const stateLayout = "2"

// stateVersion names a limit's state: the same spec in the same
// generation, the same version. A limit changed live back to a spec it had
// before (a runtime limit reset, or lapsed) is in a new generation: the
// state of its earlier time holds turns booked ahead that their tasks gave
// up when they booked again, and would keep them out.
func (l LimitConfig) stateVersion() string {
	spec := l.Spec()
	h := fnv.New32a()
	fmt.Fprintf(h, "%s %d %d %d %d %s", spec.Algorithm, spec.Limit, spec.Period, spec.Burst, spec.Windows, stateLayout)
	if l.generation != 0 {
		fmt.Fprintf(h, " %d", l.generation)
	}
	return fmt.Sprintf("%s-%08x", spec.Algorithm, h.Sum32())
}

// cost is what one task of type typ draws from each of its gates.
func (gs *gateSet) cost(typ string) int {
	if t, ok := gs.cfg.Tasks[typ]; ok {
		return t.Cost
	}
	return 1
}

// poolOf returns the pool that lends turns on claims at cost each, or nil
// if they cannot lend (a gate is not a bucket, or one with too little room
// for a lease: see throttle.NewPool). Pools are per set of gates, so there
// are at most as many as the config has queue and task type pairs; with a
// keyed gate, per key value too, and at most maxKeyedPools of those.
func (gs *gateSet) poolOf(claims []claim, cost int) *throttle.Pool {
	var key strings.Builder
	keyed := false
	for _, c := range claims {
		key.WriteString(c.g.tag)
		if c.g.expr != nil {
			// The value's length first: no value runs into the next.
			keyed = true
			key.WriteByte(' ')
			key.WriteString(strconv.Itoa(len(c.key)))
			key.WriteByte(':')
			key.WriteString(c.key)
		}
		key.WriteByte(' ')
	}
	key.WriteString(strconv.Itoa(cost))
	newPool := func() *throttle.Pool {
		poolClaims := make([]throttle.Claim, len(claims))
		for i, c := range claims {
			poolClaims[i] = throttle.Claim{Limiter: c.lim, Key: c.key, N: cost}
		}
		opts := []throttle.PoolOption{throttle.OnScriptRun(gs.countRun(claims))}
		if gs.clock != nil {
			opts = append(opts, throttle.PoolClock(gs.clock))
		}
		p, err := throttle.NewPool(poolClaims, opts...)
		if err != nil {
			return nil // these gates book every task
		}
		return p
	}
	if keyed {
		return gs.keyedPools.get(key.String(), newPool)
	}
	if p, ok := gs.pools.Load(key.String()); ok {
		return p.(*throttle.Pool)
	}
	p := newPool()
	if was, loaded := gs.pools.LoadOrStore(key.String(), p); loaded {
		return was.(*throttle.Pool)
	}
	return p
}

// countRun counts a pool's script run as one evaluation of each of its
// gates: a lease books on all of them at once; a give-back runs per gate,
// and the pool reports each run.
func (gs *gateSet) countRun(claims []claim) func() {
	if gs.evaluations == nil {
		return nil
	}
	var counters []prometheus.Counter
	for _, c := range claims {
		counters = append(counters, gs.evaluations.WithLabelValues(c.g.name))
	}
	return func() {
		for _, c := range counters {
			c.Inc()
		}
	}
}

// close gives back the turns the pools hold: gs is no longer in force.
func (gs *gateSet) close() {
	for _, gates := range []map[string]*gate{gs.drains, gs.quotas} {
		for _, g := range gates {
			if g.overrides != nil {
				g.overrides.previous.Store(nil) // see overrideGates.previous
			}
		}
	}
	gs.pools.Range(func(_, p any) bool {
		if p := p.(*throttle.Pool); p != nil {
			p.Close()
		}
		return true
	})
	gs.keyedPools.close()
}

func (gs *gateSet) quotasOf(typ string) []*gate {
	var gates []*gate
	for _, name := range gs.cfg.Tasks[typ].Quotas {
		gates = append(gates, gs.quotas[name])
	}
	return gates
}

// semaphoresOf lists the concurrency limits a task takes: its queue's,
// then its type's (per its key value with concurrency_key).
func (s *Scheduler) semaphoresOf(gs *gateSet, queue, typ string, vars *taskVars) []slot {
	var slots []slot
	if sem := gs.queueSem[queue]; sem != nil {
		// A sharded queue's shards share its slots.
		name := "queue:" + logicalQueue(gs.cfg, queue)
		slots = append(slots, slot{sem, name, name, slotPolicy(gs.cfg.Queues[queue].ConcurrencyOnRedisError)})
	}
	if sem := gs.typeSem[typ]; sem != nil {
		sl := slot{sem, "type:" + typ, "type:" + typ, slotPolicy(gs.cfg.Tasks[typ].ConcurrencyOnRedisError)}
		if expr := gs.typeKey[typ]; expr != nil {
			// The semaphore of a keyed type has a prefix of its own: the
			// key value is its key.
			sl.key = s.keyOf(sl.gate(), expr, vars)
		}
		slots = append(slots, sl)
	}
	return slots
}

// typeLabel is typ as a metric label: configured and built-in types by
// name, anything else (a producer's typo, say) as "other".
func (gs *gateSet) typeLabel(typ string) string {
	if _, ok := gs.cfg.Tasks[typ]; ok {
		return typ
	}
	if _, ok := LookupType(typ); ok {
		return typ
	}
	return "other"
}

// changedTags lists the turn tags of old's gates whose limit changed in gs.
func changedTags(old, gs *gateSet) []string {
	var stale []string
	for _, pair := range [][2]map[string]*gate{{old.drains, gs.drains}, {old.quotas, gs.quotas}} {
		for name, g := range pair[0] {
			if now, ok := pair[1][name]; !ok || now.tag != g.tag {
				stale = append(stale, g.tag)
			}
		}
	}
	return stale
}

// Levels returns, for every gate of cfg ("drain:<queue>", "quota:<name>")
// that is not keyed, how many events it could admit now: a bucket's level,
// a window's room. (A keyed gate's is per key value: KeyLoads.) It counts
// nothing. A sharded queue's drain is a gate per shard
// ("drain:<queue>~<i>"), at the share the fleet gives it now.
func Levels(ctx context.Context, rdb redis.UniversalClient, cfg Config) (map[string]int, error) {
	cfg = cfg.Defaults()
	busy, err := storedShares(ctx, rdb, cfg)
	if err != nil {
		return nil, err
	}
	gs, err := newGateSet(rdb, cfg, gateOptions{lease: slotLease, busy: busy})
	if err != nil {
		return nil, err
	}
	levels := map[string]int{}
	for _, gates := range []map[string]*gate{gs.drains, gs.quotas} {
		for _, g := range gates {
			if g.expr != nil {
				continue
			}
			level, err := g.lim.Peek(ctx, g.key)
			if err != nil {
				return nil, err
			}
			levels[g.name] = level.Remaining
		}
	}
	return levels, nil
}
