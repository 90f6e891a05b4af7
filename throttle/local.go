package throttle

import (
	"cmp"
	"context"
	"fmt"
	"hash/maphash"
	"slices"
	"sync"
	"time"

	"github.com/sluicehq/sluice/algorithms"
)

// localShards spreads keys over several locks so that callers on different
// keys rarely wait for each other.
const localShards = 32

// localLimiter makes the same transitions as the scripts, in process.
type localLimiter struct {
	base
	clock  Clock
	slack  int64 // µs kept past expiry, as the Redis engine does
	seed   maphash.Seed
	shards [localShards]localShard
	id     uint64 // orders the locks of several limiters
	// replaces: the limiter this one took the place of (Replacing), or nil.
	replaces *localLimiter
}

var _ limiter = (*localLimiter)(nil)

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
	kept    map[string]keptTurn
}

// keptTurn is a turn kept under its ID (Claim.ID) until until (µs).
type keptTurn struct {
	algorithms.Kept
	until int64
}

var nextLocalID struct {
	sync.Mutex
	n uint64
}

// NewLocal returns a Reserver that keeps its state in this process's
// memory, with the same decisions as New would make at the same instants.
// Keys are forgotten once back to their initial state, as Redis expires
// them. Book can book it together with other local limiters.
func NewLocal(spec Spec, opts ...Option) (Reserver, error) {
	c, err := compile(spec)
	if err != nil {
		return nil, err
	}
	o, err := applyOptions(spec, opts)
	if err != nil {
		return nil, err
	}
	l := newLocal(c, o.clock)
	if o.replaces != nil {
		old, ok := o.replaces.(*localLimiter)
		if !ok {
			return nil, fmt.Errorf("%w: Replacing: NewLocal replaces a limiter of NewLocal, got %T", ErrInvalidSpec, o.replaces)
		}
		if err := replacedOf(c, old.spec); err != nil {
			return nil, err
		}
		l.replaces = old
	}
	return l, nil
}

func newLocal(c compiled, clock Clock) *localLimiter {
	l := &localLimiter{base: base{spec: c}, clock: clock, seed: maphash.MakeSeed()}
	l.base.self = l
	if l.clock == nil {
		l.clock = SystemClock{}
	} else {
		l.slack = injectedClockSlack.Microseconds()
	}
	for i := range l.shards {
		l.shards[i].entries = make(map[string]*localEntry)
		l.shards[i].sweepAt = 1024
	}
	nextLocalID.Lock()
	nextLocalID.n++
	l.id = nextLocalID.n
	nextLocalID.Unlock()
	return l
}

func (l *localLimiter) site(string) site { return localSite{} }

func (l *localLimiter) policy() (string, limiter) { return "", nil }

func (l *localLimiter) now() time.Time { return l.clock.Now() }

func (l *localLimiter) shardIndex(key string) int {
	return int(maphash.String(l.seed, key) % localShards)
}

func (l *localLimiter) shard(key string) *localShard { return &l.shards[l.shardIndex(key)] }

// entry returns key's entry, or a new one that is not stored yet.
func (s *localShard) entry(key string, a *algorithms.Algorithm) *localEntry {
	if e := s.entries[key]; e != nil {
		return e
	}
	return &localEntry{state: a.NewState()}
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

// keep applies what a step did at now to the turn kept under id: keeps the
// turn at at until past it by late (µs; rounded up to the ms, as Redis
// keeps it), or forgets it.
func keep(e *localEntry, id string, now, at int64, c algorithms.Counted, late int64) {
	if c.Forget {
		delete(e.kept, id)
	}
	if c.Keep {
		if e.kept == nil {
			e.kept = map[string]keptTurn{}
		}
		e.kept[id] = keptTurn{algorithms.Kept{At: at, Pieces: c.Pieces}, now + (at-now+max(late, 0)+999)/1000*1000}
	}
}

// localSite decides the claims of local limiters, under the locks of their
// keys' shards, taken in one order so that callers never deadlock.
type localSite struct{}

func (localSite) reaches(string) bool { return false }

func (localSite) run(_ context.Context, st *step) error {
	type lock struct {
		lim   *localLimiter
		shard int
	}
	var locks []lock
	for _, p := range st.parts {
		l := p.lim.(*localLimiter)
		if k := (lock{l, l.shardIndex(p.key)}); !slices.Contains(locks, k) {
			locks = append(locks, k)
		}
		if r := l.replaces; r != nil {
			if k := (lock{r, r.shardIndex(p.key)}); !slices.Contains(locks, k) {
				locks = append(locks, k)
			}
		}
	}
	slices.SortFunc(locks, func(a, b lock) int {
		return cmp.Or(cmp.Compare(a.lim.id, b.lim.id), cmp.Compare(a.shard, b.shard))
	})
	for _, k := range locks {
		mu := &k.lim.shards[k.shard].mu
		mu.Lock()
		defer mu.Unlock()
	}
	first := st.parts[0].lim.(*localLimiter)
	now := first.clock.Now().UnixMicro()
	entries := make([]*localEntry, len(st.parts))
	claims := make([]algorithms.Claim, len(st.parts))
	for i, p := range st.parts {
		l := p.lim.(*localLimiter)
		entries[i] = l.shard(p.key).entry(p.key, l.spec.algorithm)
		if r := l.replaces; r != nil {
			// As the script does, for every operation (algorithms.TakeOver).
			old := r.shard(p.key).entry(p.key, r.spec.algorithm)
			if algorithms.TakeOver(entries[i].state, l.spec.params, old.state, r.spec.params, now) {
				entries[i].blocked = max(entries[i].blocked, old.blocked)
			}
		}
		claims[i] = algorithms.Claim{State: entries[i].state, Params: l.spec.params, Blocked: entries[i].blocked, N: p.n, ID: p.id}
		if st.giveBack != nil {
			claims[i].GiveBack = st.giveBack[i]
		}
		if k, ok := entries[i].kept[p.id]; ok && p.id != "" && k.until > now {
			claims[i].Kept = &algorithms.Kept{At: k.At, Pieces: k.Pieces}
		}
	}
	switch st.op {
	case algorithms.OpPeek:
		st.out = algorithms.Booking{Now: now, At: now}
		for _, c := range claims {
			room, blockedFor, resetAfter := algorithms.Peek(c.State, c.Params, now, c.Blocked)
			st.out.Claims = append(st.out.Claims, algorithms.Counted{Remaining: room, RetryAfter: blockedFor, ResetAfter: resetAfter})
		}
	case algorithms.OpBlock:
		until := now + st.notBefore
		for _, e := range entries {
			e.blocked = max(e.blocked, until)
		}
		st.out = algorithms.Booking{OK: true, Now: now, At: until, Claims: make([]algorithms.Counted, len(claims))}
	case algorithms.OpCancel:
		st.out = algorithms.Booking{OK: true, Now: now, At: now, Claims: make([]algorithms.Counted, len(claims))}
		for i, c := range claims {
			c.State.Trim(c.Params, now)
			switch {
			case c.ID != "" && c.Kept != nil:
				c.State.GiveBack(c.Params, c.Kept.Pieces, c.N)
				st.out.Claims[i].Forget = true
			case c.ID == "" && c.GiveBack != "":
				c.State.GiveBack(c.Params, c.GiveBack, c.N)
			}
		}
	case algorithms.OpSeries:
		// The local engine counts no recent throttles (WithRecentThrottles
		// is Redis's).
		st.series, _ = algorithms.Series(claims, len(st.ids), now, st.notBefore, st.maxWait, st.minAhead)
	default:
		notBefore := st.notBefore
		if st.ahead > 0 {
			notBefore = now + st.ahead
		}
		st.out = algorithms.Book(claims, now, notBefore, st.maxWait, st.exact, st.late, st.keepAfter)
	}
	for i, p := range st.parts {
		l := p.lim.(*localLimiter)
		e, c := entries[i], claims[i]
		if i < len(st.out.Claims) {
			keep(e, p.id, now, st.out.At, st.out.Claims[i], max(st.late, 0)+l.slack)
		}
		for t, turn := range st.series {
			keep(e, st.ids[t], now, turn.At, turn.Claims[i], max(st.late, 0)+l.slack)
		}
		// The entry lives as long as the script would let its key live
		// (the script sets the TTL on every call), and its kept turns.
		sh := l.shard(p.key)
		life := max(c.State.ResetAfter(c.Params, now), e.blocked-now, 0) + l.slack
		for id, k := range e.kept {
			if k.until <= now {
				delete(e.kept, id)
			} else {
				life = max(life, k.until-now)
			}
		}
		if life > 0 {
			e.expires = now + life
			sh.entries[p.key] = e
			sh.sweep(now)
		} else {
			delete(sh.entries, p.key)
		}
	}
	return nil
}
