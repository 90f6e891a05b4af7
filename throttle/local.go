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
	slack  int64 // µs kept past expiry, as the Redis engine does
	seed   maphash.Seed
	shards [localShards]localShard
}

type localShard struct {
	mu      sync.Mutex
	entries map[string]*localEntry
	sweepAt int // sweep expired entries when the map grows past this
}

// localEntry is one key's state and block. It is forgotten once back to
// its initial value and unblocked (plus the slack an injected clock gets,
// as on Redis); until then it is used even when expired, where it acts as
// the initial value would.
type localEntry struct {
	state   algorithms.State
	blocked int64 // µs until which nothing is counted
	expires int64 // µs
}

// entry returns key's entry, or a new one that is not stored yet.
func (s *localShard) entry(key string, a *algorithms.Algorithm) *localEntry {
	if e := s.entries[key]; e != nil {
		return e
	}
	return &localEntry{state: a.NewState()}
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
	} else {
		l.slack = injectedClockSlack.Microseconds()
	}
	for i := range l.shards {
		l.shards[i].entries = make(map[string]*localEntry)
		l.shards[i].sweepAt = 1024
	}
	return l, nil
}

// AllowN implements Limiter.
func (l *localLimiter) AllowN(ctx context.Context, key string, n int) (Decision, error) {
	if err := l.checkCost(n); err != nil {
		return Decision{}, err
	}
	return decision(l.reserve(key, n, 0, -1)), nil
}

// ReserveN implements Reserver.
func (l *localLimiter) ReserveN(ctx context.Context, key string, n int, maxWait time.Duration) (Reservation, error) {
	return l.ReserveAfter(ctx, key, n, time.Time{}, maxWait)
}

// ReserveAfter implements Reserver.
func (l *localLimiter) ReserveAfter(ctx context.Context, key string, n int, notBefore time.Time, maxWait time.Duration) (Reservation, error) {
	if err := l.checkReserve(n, maxWait); err != nil {
		return Reservation{}, err
	}
	return reservation(l.reserve(key, n, unixMicros(notBefore), maxWait.Microseconds()), n), nil
}

// reserve is algorithms.Reserve on key's state; maxWait < 0 never reserves.
func (l *localLimiter) reserve(key string, n int, notBefore, maxWait int64) algorithms.Result {
	now := l.clock.Now().UnixMicro()
	shard := l.shard(key)
	shard.mu.Lock()
	defer shard.mu.Unlock()
	e := shard.entry(key, l.algorithm)
	r := algorithms.Reserve(e.state, l.params, now, e.blocked, notBefore, int64(n), maxWait)
	if r.Allowed {
		e.expires = max(e.expires, now+r.ResetAfter+l.slack)
		shard.entries[key] = e
		shard.sweep(now)
	}
	return r
}

// Cancel implements Reserver.
func (l *localLimiter) Cancel(ctx context.Context, key string, r Reservation) error {
	if err := l.checkReservation(r); err != nil {
		return err
	}
	now := l.clock.Now().UnixMicro()
	shard := l.shard(key)
	shard.mu.Lock()
	defer shard.mu.Unlock()
	if e := shard.entries[key]; e != nil {
		algorithms.Cancel(e.state, l.params, now, r.At.UnixMicro(), int64(r.N))
	}
	return nil
}

// Peek implements Reserver.
func (l *localLimiter) Peek(ctx context.Context, key string) (Level, error) {
	now := l.clock.Now().UnixMicro()
	shard := l.shard(key)
	shard.mu.Lock()
	defer shard.mu.Unlock()
	e := shard.entry(key, l.algorithm)
	remaining, blockedFor := algorithms.Peek(e.state, l.params, now, e.blocked)
	return Level{Remaining: int(remaining), BlockedFor: micros(blockedFor)}, nil
}

// Block implements Reserver.
func (l *localLimiter) Block(ctx context.Context, key string, d time.Duration) error {
	if d <= 0 {
		return nil
	}
	now := l.clock.Now().UnixMicro()
	shard := l.shard(key)
	shard.mu.Lock()
	defer shard.mu.Unlock()
	e := shard.entry(key, l.algorithm)
	e.blocked = max(e.blocked, now+d.Microseconds())
	e.expires = max(e.expires, e.blocked+l.slack)
	shard.entries[key] = e
	return nil
}

func (l *localLimiter) shard(key string) *localShard {
	return &l.shards[maphash.String(l.seed, key)%localShards]
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
