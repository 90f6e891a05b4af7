package throttle

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// KeptTurn returns the instant of the turn kept under id on key of lim (see
// Claim.ID): a turn booked ahead that its holder has not used or given
// back yet; ok is false if there is none. It reads the turn and changes
// nothing: for tools that tell when a booked task will run. lim is a
// limiter of New, NewFairShare or NewLocal; the instant is on the
// limiters' clock.
func KeptTurn(ctx context.Context, lim Limiter, key, id string) (at time.Time, ok bool, err error) {
	switch l := lim.(type) {
	case *redisLimiter:
		state := redisKey(l.prefix, key)
		if l.fair != nil {
			state = redisKey(l.prefix, l.fair.tag)
		}
		kept, err := l.calls.rdb.Get(ctx, keptKey(state, id)).Result()
		if errors.Is(err, redis.Nil) {
			return time.Time{}, false, nil
		}
		if err != nil {
			return time.Time{}, false, fmt.Errorf("throttle: reading a kept turn: %w", err)
		}
		us, _, found := strings.Cut(kept, ";")
		n, err := strconv.ParseInt(us, 10, 64)
		if !found || err != nil {
			return time.Time{}, false, fmt.Errorf("throttle: a kept turn reads %q, want \"<µs>;<pieces>\"", kept)
		}
		return time.UnixMicro(n), true, nil
	case *localLimiter:
		s := l.shard(key)
		s.mu.Lock()
		defer s.mu.Unlock()
		e := s.entries[key]
		if e == nil {
			return time.Time{}, false, nil
		}
		k, ok := e.kept[id]
		if !ok || l.clock.Now().UnixMicro() >= k.until {
			return time.Time{}, false, nil
		}
		return time.UnixMicro(k.At), true, nil
	}
	return time.Time{}, false, fmt.Errorf("%w: KeptTurn reads a limiter of New, NewFairShare or NewLocal, got %T", ErrMisuse, lim)
}
