package throttle

import (
	"context"
	"hash/maphash"
	"sync"
	"time"

	"github.com/sluicehq/sluice/algorithms"
)

type systemClock struct{}

func (systemClock) Now() time.Time { return time.Now() }

// localShards spreads keys over several locks so that callers on different
// keys rarely wait for each other.
const localShards = 32

// localLimiter makes the same transitions as the scripts, in process.
type localLimiter struct {
	compiled
	clock  Clock
	seed   maphash.Seed
	shards [localShards]localShard
}

type localShard struct {
	mu      sync.Mutex
	entries map[string]*localEntry
	sweepAt int // sweep expired entries when the map grows past this
}

type localEntry struct {
	state   algorithms.State
	expires int64 // µs; from then on the state is back to its initial value
}

// NewLocal returns a Limiter that keeps its state in this process's memory,
// with the same decisions as New would make at the same instants. Keys are
// forgotten once back to their initial state, as Redis expires them.
func NewLocal(spec Spec, opts ...Option) (Limiter, error) {
	c, err := compile(spec)
	if err != nil {
		return nil, err
	}
	o, err := applyOptions(spec, opts)
	if err != nil {
		return nil, err
	}
	l := &localLimiter{compiled: c, clock: o.clock, seed: maphash.MakeSeed()}
	if l.clock == nil {
		l.clock = systemClock{}
	}
	for i := range l.shards {
		l.shards[i].entries = make(map[string]*localEntry)
		l.shards[i].sweepAt = 1024
	}
	return l, nil
}

// AllowN implements Limiter.
func (l *localLimiter) AllowN(_ context.Context, key string, n int) (Decision, error) {
	if err := l.checkCost(n); err != nil {
		return Decision{}, err
	}
	now := l.clock.Now().UnixMicro()
	shard := &l.shards[maphash.String(l.seed, key)%localShards]
	shard.mu.Lock()
	defer shard.mu.Unlock()
	e := shard.entries[key]
	if e == nil || now >= e.expires {
		e = &localEntry{state: l.algorithm.NewState()}
	}
	r := e.state.Step(l.params, now, int64(n))
	if r.Allowed {
		e.expires = now + r.ResetAfter
		shard.entries[key] = e
		shard.sweep(now)
	}
	return decision(r), nil
}

// sweep drops expired entries once the map has doubled since the last sweep,
// so memory follows the live keys at amortised constant cost.
func (s *localShard) sweep(now int64) {
	if len(s.entries) < s.sweepAt {
		return
	}
	for k, e := range s.entries {
		if now >= e.expires {
			delete(s.entries, k)
		}
	}
	s.sweepAt = max(1024, 2*len(s.entries))
}
