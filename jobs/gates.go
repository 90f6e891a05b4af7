package jobs

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"math"
	"slices"
	"sort"
	"sync"
	"time"

	"github.com/hibiken/asynq"
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
}

// gate is one rate limit on Redis, with its failure policy.
type gate struct {
	name   string // metric label: "drain:<queue>" or "quota:<name>"
	tag    string // what a task's turns are kept under: name@version
	key    string // the limiter key: the queue or quota name
	limit  LimitConfig
	remote throttle.Reserver

	mu      sync.Mutex
	local   throttle.Reserver // the local policy's twin, at the limit / workers
	workers int64             // what local was divided by
}

func newGateSet(rdb redis.UniversalClient, cfg Config) (*gateSet, error) {
	gs := &gateSet{cfg: cfg, drains: map[string]*gate{}, quotas: map[string]*gate{},
		queueSem: map[string]*throttle.Semaphore{}, typeSem: map[string]*throttle.Semaphore{}}
	newGate := func(kind, name string, l LimitConfig) (*gate, error) {
		// A changed limit starts from a fresh state under a new version: the
		// old state holds turns booked at the old rate, which would keep the
		// queue at that rate until they are all used. Turns booked under an
		// old version are booked again.
		spec := l.Spec()
		version := specVersion(spec)
		lim, err := throttle.New(rdb, spec, throttle.WithPrefix("sluice:"+kind+":"+version+":"))
		if err != nil {
			return nil, fmt.Errorf("jobs: %s %q: %w", kind, name, err)
		}
		remote, _ := throttle.AsReserver(lim)
		return &gate{name: kind + ":" + name, tag: kind + ":" + name + "@" + version, key: name, limit: l, remote: remote}, nil
	}
	newSem := func(limit int) (*throttle.Semaphore, error) {
		return throttle.NewSemaphore(rdb, limit, slotLease, throttle.WithPrefix("sluice:concurrency:"))
	}
	for name, q := range cfg.Queues {
		if q.Drain != nil {
			g, err := newGate("drain", name, *q.Drain)
			if err != nil {
				return nil, err
			}
			gs.drains[name] = g
		}
		if q.Concurrency > 0 {
			sem, err := newSem(q.Concurrency)
			if err != nil {
				return nil, err
			}
			gs.queueSem[name] = sem
		}
	}
	for name, l := range cfg.Quotas {
		g, err := newGate("quota", name, l)
		if err != nil {
			return nil, err
		}
		gs.quotas[name] = g
	}
	for name, t := range cfg.Tasks {
		if t.Concurrency > 0 {
			sem, err := newSem(t.Concurrency)
			if err != nil {
				return nil, err
			}
			gs.typeSem[name] = sem
		}
	}
	return gs, nil
}

// cost is what one task of type typ draws from each of its gates.
// specVersion names a spec's state: the same spec, the same version.
func specVersion(spec throttle.Spec) string {
	h := fnv.New32a()
	fmt.Fprintf(h, "%s %d %d %d %d", spec.Algorithm, spec.Limit, spec.Period, spec.Burst, spec.Windows)
	return fmt.Sprintf("%s-%08x", spec.Algorithm, h.Sum32())
}

func (gs *gateSet) cost(typ string) int {
	if t, ok := gs.cfg.Tasks[typ]; ok {
		return t.Cost
	}
	return 1
}

// gatesOf lists the gates a task passes, in order: its queue's drain gate,
// then its type's quotas.
func (gs *gateSet) gatesOf(queue, typ string) []*gate {
	var gates []*gate
	if g := gs.drains[queue]; g != nil {
		gates = append(gates, g)
	}
	return append(gates, gs.quotasOf(typ)...)
}

func (gs *gateSet) quotasOf(typ string) []*gate {
	var gates []*gate
	for _, name := range gs.cfg.Tasks[typ].Quotas {
		gates = append(gates, gs.quotas[name])
	}
	return gates
}

func (gs *gateSet) semaphoresOf(queue, typ string) []slot {
	var slots []slot
	if sem := gs.queueSem[queue]; sem != nil {
		slots = append(slots, slot{sem, "queue:" + queue})
	}
	if sem := gs.typeSem[typ]; sem != nil {
		slots = append(slots, slot{sem, "type:" + typ})
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

// booking is the outcome of putting a task through its rate gates.
type booking struct {
	turns    []heldTurn    // every Redis turn the task holds, to carry if it is requeued
	ready    time.Time     // on our clock: when the last of its turns comes
	deferFor time.Duration // > 0: some gate has no turn within ReserveMax; ask again after this long
}

// errRedisDeny makes book wait and try again: a gate's Redis failed and
// its policy is deny.
var errRedisDeny = errors.New("jobs: redis unavailable and the gate's policy is deny")

// book gives the task a turn on each of its rate gates, the same instant on
// all of them: a gate that can only offer a later turn moves the others'
// turns to it (giving the earlier ones back), so that no limit sees the
// task's call at another time than it happens. Turns the task already
// holds (it was requeued) are kept and cost no script call.
func (s *Scheduler) book(ctx context.Context, gs *gateSet, queue string, t *asynq.Task, cost int) (booking, error) {
	gates := gs.gatesOf(queue, t.Type())
	held := readTurns(t.Headers())
	for {
		b, err := s.tryBook(ctx, gs, gates, held, cost)
		if !errors.Is(err, errRedisDeny) {
			return b, err
		}
		select {
		case <-ctx.Done():
			return booking{}, ctx.Err()
		case <-time.After(redisRetry):
		}
	}
}

func (s *Scheduler) tryBook(ctx context.Context, gs *gateSet, gates []*gate, held map[string]heldTurn, cost int) (booking, error) {
	maxWait := gs.cfg.Worker.ReserveMax
	var b booking
	var target time.Time // on Redis's clock: the later turn every gate must give; zero: now
	var toBook []*gate
	for _, g := range gates {
		if h, ok := held[g.tag]; ok {
			s.metrics.decisions.WithLabelValues(g.name, "held").Inc()
			b.turns = append(b.turns, h)
			target = later(target, h.at())
			b.ready = later(b.ready, s.local(h.at()))
		} else {
			toBook = append(toBook, g)
		}
	}
	booked := make(map[*gate]turn, len(toBook))
	cancelAll := func() {
		for g, tn := range booked {
			if tn.remote {
				s.cancel(ctx, g, tn.res)
			}
		}
	}
	// First every gate at once: when no gate makes the task wait, that is
	// all it costs, one round trip.
	turns, errs := s.reserveAll(ctx, toBook, cost, target, maxWait)
	var refused *gate
	for i, g := range toBook {
		if errs[i] == nil && turns[i].res.OK {
			booked[g] = turns[i]
		} else if errs[i] == nil && refused == nil {
			refused = g
		}
	}
	if err := errors.Join(errs...); err != nil || refused != nil {
		cancelAll()
		if err != nil {
			return booking{}, err
		}
		s.metrics.decisions.WithLabelValues(refused.name, "deferred").Inc()
		return booking{deferFor: max(turns[slices.Index(toBook, refused)].res.Delay-maxWait, 0) + time.Second}, nil
	}
	// Then the turns are brought to one instant, the latest one offered, so
	// that no limit sees the task's call at another time than it happens: a
	// gate whose turn is earlier gives it back and is asked again from that
	// instant. It may offer a later one still, so this settles in a round
	// or two; three bound it.
	for round := 0; round < 3; round++ {
		for _, tn := range booked {
			if tn.remote && tn.res.Delay > 0 {
				target = later(target, tn.res.At)
			}
		}
		var behind []*gate
		for g, tn := range booked {
			if tn.remote && !target.IsZero() && tn.res.At.Before(target) {
				behind = append(behind, g)
			}
		}
		if len(behind) == 0 {
			break
		}
		for _, g := range behind {
			s.cancel(ctx, g, booked[g].res)
			delete(booked, g)
			tn, err := s.reserve(ctx, g, cost, target, maxWait)
			if err != nil || !tn.res.OK {
				cancelAll()
				if err != nil {
					return booking{}, err
				}
				s.metrics.decisions.WithLabelValues(g.name, "deferred").Inc()
				return booking{deferFor: max(tn.res.Delay-maxWait, 0) + time.Second}, nil
			}
			booked[g] = tn
		}
	}
	for g, tn := range booked {
		result := "now"
		if tn.res.Delay > 0 {
			result = "reserved"
		}
		s.metrics.decisions.WithLabelValues(g.name, result).Inc()
		b.ready = later(b.ready, tn.ready)
		if tn.remote {
			b.turns = append(b.turns, heldTurn{Gate: g.tag, At: tn.res.At.UnixMicro(), N: cost})
		}
	}
	sort.Slice(b.turns, func(i, j int) bool { return b.turns[i].Gate < b.turns[j].Gate })
	return b, nil
}

// reserveAll books cost events on every gate at once, no earlier than
// notBefore.
func (s *Scheduler) reserveAll(ctx context.Context, gates []*gate, cost int, notBefore time.Time, maxWait time.Duration) ([]turn, []error) {
	turns, errs := make([]turn, len(gates)), make([]error, len(gates))
	if len(gates) == 1 {
		turns[0], errs[0] = s.reserve(ctx, gates[0], cost, notBefore, maxWait)
		return turns, errs
	}
	var wg sync.WaitGroup
	for i, g := range gates {
		wg.Go(func() { turns[i], errs[i] = s.reserve(ctx, g, cost, notBefore, maxWait) })
	}
	wg.Wait()
	return turns, errs
}

// turn is one gate's answer to one task.
type turn struct {
	res    throttle.Reservation
	remote bool      // booked on Redis (else by a failure policy, in this process)
	ready  time.Time // on our clock: when the turn comes
}

// reserve books cost events on g no earlier than notBefore, applying g's
// failure policy when Redis cannot be used.
func (s *Scheduler) reserve(ctx context.Context, g *gate, cost int, notBefore time.Time, maxWait time.Duration) (turn, error) {
	start := time.Now()
	res, err := g.remote.ReserveAfter(ctx, g.key, cost, notBefore, maxWait)
	s.metrics.scriptSeconds.WithLabelValues(g.name).Observe(time.Since(start).Seconds())
	s.metrics.evaluations.WithLabelValues(g.name).Inc()
	if err == nil {
		s.metrics.remaining.WithLabelValues(g.name).Set(float64(res.Remaining))
		return turn{res: res, remote: true, ready: time.Now().Add(res.Delay)}, nil
	}
	if errors.Is(err, throttle.ErrInvalidCost) || ctx.Err() != nil {
		return turn{}, err
	}
	s.metrics.redisErrors.WithLabelValues(g.name).Inc()
	s.metrics.fallbacks.WithLabelValues(g.name, g.limit.OnRedisError).Inc()
	s.log.Warn("gate cannot reach redis", "gate", g.name, "policy", g.limit.OnRedisError, "err", err)
	switch g.limit.OnRedisError {
	case OnRedisErrorAllow:
		return turn{res: throttle.Reservation{OK: true, N: cost}, ready: time.Now()}, nil
	case OnRedisErrorLocal:
		res, err := g.localTwin(s.workers.Load()).ReserveN(ctx, g.key, cost, maxWait)
		if err != nil {
			return turn{}, fmt.Errorf("%w: %v", errRedisDeny, err)
		}
		return turn{res: res, ready: time.Now().Add(res.Delay)}, nil
	}
	return turn{}, errRedisDeny
}

// cancel gives back a turn that will not be used.
func (s *Scheduler) cancel(ctx context.Context, g *gate, res throttle.Reservation) {
	s.metrics.evaluations.WithLabelValues(g.name).Inc()
	if err := g.remote.Cancel(ctx, g.key, res); err != nil {
		s.log.Warn("cannot give back a turn; it is lost", "gate", g.name, "err", err)
	}
}

// localTwin returns the in-process limiter of the local policy: the gate's
// limit divided among the live workers.
func (g *gate) localTwin(workers int64) throttle.Reserver {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.local == nil || g.workers != workers {
		lim, err := throttle.NewLocal(localSpec(g.limit, workers))
		if err != nil {
			// A divided limit is always a valid spec; keep the undivided one
			// rather than none.
			lim, _ = throttle.NewLocal(g.limit.Spec())
		}
		g.local, _ = throttle.AsReserver(lim)
		g.workers = workers
	}
	return g.local
}

// localSpec divides a limit among the live workers, for the local policy.
func localSpec(l LimitConfig, workers int64) throttle.Spec {
	spec := l.Spec()
	share := func(v int) int { return max(1, int(math.Ceil(float64(v)/float64(workers)))) }
	spec.Limit = share(spec.Limit)
	if spec.Burst > 0 {
		spec.Burst = share(spec.Burst)
	}
	return spec
}

func later(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}

// Levels returns, for every gate of cfg ("drain:<queue>", "quota:<name>"),
// how many events it could admit now: a bucket's level, a window's room.
// It counts nothing.
func Levels(ctx context.Context, rdb redis.UniversalClient, cfg Config) (map[string]int, error) {
	gs, err := newGateSet(rdb, cfg.Defaults())
	if err != nil {
		return nil, err
	}
	levels := map[string]int{}
	for _, gates := range []map[string]*gate{gs.drains, gs.quotas} {
		for _, g := range gates {
			level, err := g.remote.Peek(ctx, g.key)
			if err != nil {
				return nil, err
			}
			levels[g.name] = level.Remaining
		}
	}
	return levels, nil
}
