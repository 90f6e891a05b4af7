package httplimit

import (
	"cmp"
	"context"
	"fmt"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/throttle"
)

// banner keeps bans in Redis with three throttle limiters, keyed by the
// banned identity ("ip:" and an ip limit's key, or a Client.ID):
//
//   - refusals, a sliding_log of After per Within, counts refusals. The one
//     it admits with nothing left is the After-th within Within and bans;
//     only that one, so that concurrent refusals that cross the threshold
//     together ban once. Those it denies are already past the threshold:
//     requests under way when the ban began, or, when For is shorter than
//     Within, refusals soon after a ban, until its refusals age out.
//   - strikes, a leaky_bucket of maxStrikes leaking one per Forget, counts
//     bans: each pours one strike in, and with s strikes in the bucket a
//     ban lasts For × 2^(s-1), at most Max. A full bucket denies the
//     strike, and the ban lasts Max.
//   - bans holds each ban as a throttle Block, and is asked with Peek,
//     which counts nothing, how much longer an identity is banned.
type banner struct {
	Ban
	maxStrikes    int
	refusals      throttle.Limiter
	strikes, bans throttle.Reserver
}

func newBanner(rdb redis.UniversalClient, b Ban, prefix string, opts []throttle.Option) (*banner, error) {
	if b == (Ban{}) {
		return nil, nil
	}
	switch {
	case b.After <= 0:
		return nil, fmt.Errorf("httplimit: Ban.After must be > 0, got %d", b.After)
	case b.For <= 0:
		return nil, fmt.Errorf("httplimit: Ban.For must be > 0, got %v", b.For)
	case b.Max != 0 && b.Max < b.For:
		return nil, fmt.Errorf("httplimit: Ban.Max must be at least Ban.For (%v) or 0, got %v", b.For, b.Max)
	case b.Forget < 0:
		return nil, fmt.Errorf("httplimit: Ban.Forget must be >= 0 (0 means Max), got %v", b.Forget)
	}
	b.Max = cmp.Or(b.Max, b.For)
	b.Forget = cmp.Or(b.Forget, b.Max)
	bn := &banner{Ban: b, maxStrikes: 1}
	for d := b.For; d > 0 && d < b.Max; d *= 2 {
		bn.maxStrikes++
	}
	newLimiter := func(field, name string, spec throttle.Spec) (throttle.Reserver, error) {
		lim, err := throttle.New(rdb, spec, append(opts, throttle.WithPrefix(prefix+"ban:"+name+":"))...)
		if err != nil {
			return nil, fmt.Errorf("httplimit: Ban.%s: %w", field, err)
		}
		return lim, nil
	}
	var err error
	if bn.refusals, err = newLimiter("Within", "refusals", throttle.Spec{Algorithm: throttle.SlidingLog, Limit: b.After, Period: b.Within}); err != nil {
		return nil, err
	}
	if bn.strikes, err = newLimiter("Forget", "strikes", throttle.Spec{Algorithm: throttle.LeakyBucket, Limit: 1, Period: b.Forget, Burst: bn.maxStrikes}); err != nil {
		return nil, err
	}
	if bn.bans, err = newLimiter("For", "bans", throttle.Spec{Algorithm: throttle.FixedWindow, Limit: 1 << 40, Period: time.Millisecond}); err != nil {
		return nil, err
	}
	return bn, nil
}

// check returns how much longer id is banned; 0 if it is not.
func (b *banner) check(ctx context.Context, id string) (time.Duration, error) {
	level, err := b.bans.Peek(ctx, id)
	return level.BlockedFor, err
}

// refused counts a refusal of id and bans id if it was the After-th within
// Within: it returns the new ban's length, 0 if there is none. Refusals
// are counted afresh after each ban (under the number of strikes id has),
// so that a client that goes on after its ban is banned again, for longer,
// once it has been refused After more times.
func (b *banner) refused(ctx context.Context, id string) (time.Duration, error) {
	level, err := b.strikes.Peek(ctx, id)
	if err != nil {
		return 0, err
	}
	generation := strconv.Itoa(b.maxStrikes - level.Remaining)
	d, err := b.refusals.AllowN(ctx, id+"#"+generation, 1)
	if err != nil || !d.Allowed || d.Remaining > 0 {
		return 0, err
	}
	strikes := b.maxStrikes
	s, err := b.strikes.AllowN(ctx, id, 1)
	if err != nil {
		return 0, err
	}
	if s.Allowed {
		strikes -= s.Remaining
	}
	length := b.For
	for i := 1; i < strikes && length < b.Max; i++ {
		length *= 2
	}
	length = min(length, b.Max)
	if err := b.bans.Block(ctx, id, length); err != nil {
		return 0, err
	}
	return length, nil
}
