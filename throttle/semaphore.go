package throttle

import (
	"context"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/lua"
)

var semaphoreScript = redis.NewScript(lua.Semaphore)

// Semaphore bounds how many holders run at once across a whole fleet. Each
// holder has a lease that it renews while it runs; a holder that dies stops
// renewing and its slot comes back when the lease ends.
//
// Every operation is keyed by its holder, so running one twice does what
// running it once does: unlike the limiters' calls, a call whose reply was
// lost may be sent again, and go-redis's retries are left as they are. A
// holder whose Acquire failed without an answer may hold a slot, though:
// Release it (or Acquire again to learn).
type Semaphore struct {
	rdb    redis.UniversalClient
	limit  int
	lease  time.Duration
	prefix string
	clock  Clock // nil: Redis TIME
	recent bool  // WithRecentThrottles
}

// NewSemaphore returns a Semaphore of limit slots per key with leases of
// lease (renew well within it: a third is usual). WithPrefix and WithClock
// apply as for New; the default prefix is "sluice:semaphore:".
func NewSemaphore(rdb redis.UniversalClient, limit int, lease time.Duration, opts ...Option) (*Semaphore, error) {
	if limit <= 0 {
		return nil, fmt.Errorf("%w: semaphore limit must be > 0, got %d", ErrInvalidSpec, limit)
	}
	if lease < time.Millisecond {
		return nil, fmt.Errorf("%w: semaphore lease must be at least 1ms, got %v", ErrInvalidSpec, lease)
	}
	o, err := applyOptions(Spec{Algorithm: "semaphore"}, opts)
	if err != nil {
		return nil, err
	}
	return &Semaphore{rdb: rdb, limit: limit, lease: lease, prefix: o.prefix, clock: o.clock, recent: o.recent}, nil
}

// SemaphoreState is the answer of Acquire and Renew.
type SemaphoreState struct {
	Held    bool          // the holder has a slot, with a fresh lease
	Holders int           // slots taken now, this holder's included
	Free    time.Duration // when not Held: until the first lease ends (if nobody releases first)
	// Lapsed (Renew only): the holder's lease had ended, so it ran
	// uncounted since, and others may have taken its slot. Held tells
	// whether it took a free slot again; if not, it must stop.
	Lapsed bool
}

// Acquire takes a slot of key for holder if one is free, or renews the
// lease holder has already.
func (s *Semaphore) Acquire(ctx context.Context, key, holder string) (SemaphoreState, error) {
	return s.run(ctx, "acquire", key, holder)
}

// Renew extends holder's lease. If the lease had ended, Lapsed is true and
// the holder takes a free slot again if there is one (Held), as Acquire
// would; Held is false if there was none.
func (s *Semaphore) Renew(ctx context.Context, key, holder string) (SemaphoreState, error) {
	return s.run(ctx, "renew", key, holder)
}

// Release gives holder's slot back.
func (s *Semaphore) Release(ctx context.Context, key, holder string) error {
	_, err := s.run(ctx, "release", key, holder)
	return err
}

func (s *Semaphore) run(ctx context.Context, op, key, holder string) (SemaphoreState, error) {
	now := ""
	if s.clock != nil {
		now = fmt.Sprint(s.clock.Now().UnixMicro())
	}
	keys := []string{redisKey(s.prefix, key)}
	if s.recent {
		keys = append(keys, recentKey(keys[0]))
	}
	reply, err := semaphoreScript.Run(ctx, s.rdb, keys,
		now, op, holder, s.limit, s.lease.Microseconds()).Int64Slice()
	if err != nil {
		return SemaphoreState{}, fmt.Errorf("throttle: semaphore %s: %w", op, err)
	}
	if len(reply) != 4 {
		return SemaphoreState{}, fmt.Errorf("throttle: semaphore script replied %v, want 4 integers", reply)
	}
	return SemaphoreState{Held: reply[0] == 1, Holders: int(reply[1]), Free: micros(reply[2]), Lapsed: reply[3] == 1}, nil
}
