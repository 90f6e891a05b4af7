package throttle_test

import (
	"context"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/internal/redistest"
	"github.com/sluicehq/sluice/throttle"
)

// TestRemind: a booking whose turn is further than the remind's wait notes
// the member in the sorted set, scored the lead before the turn, in the
// same script run (one call: sluice's wake set costs no second trip); a
// nearer turn is not noted; a booking in another slot than the set (on a
// cluster), or on local limiters, notes nothing and says so.
func TestRemind(t *testing.T) {
	for _, e := range engines(t) {
		t.Run(e.name, func(t *testing.T) {
			ctx := context.Background()
			drain, _ := mustLimiter(t, e, drainSpec) // 25/s, burst 1: turns 40ms apart
			set := "{q}:" + redistest.Prefix(t) + "wake"
			remind := func(member string) throttle.BookOption {
				return throttle.Remind(set, member, 10*time.Millisecond, 50*time.Millisecond)
			}
			var booked []throttle.Booking
			for i, member := range []string{"now", "in40ms", "in80ms"} {
				b, err := throttle.Book(ctx, []throttle.Claim{{Limiter: drain, Key: "q", N: 1}}, time.Time{}, time.Second, remind(member))
				if err != nil || !b.OK || b.Delay != time.Duration(i)*40*time.Millisecond {
					t.Fatalf("booking %d = %+v, %v; want OK %dms ahead", i, b, err, 40*i)
				}
				booked = append(booked, b)
			}
			if e.rdb == nil {
				for i, b := range booked {
					if b.Reminded {
						t.Errorf("booking %d on local limiters says it noted its turn", i)
					}
				}
				return
			}
			// Only the turn 80ms ahead is more than 50ms away.
			for i, want := range []bool{false, false, true} {
				if booked[i].Reminded != want {
					t.Errorf("booking %d (%v ahead): Reminded %v, want %v", i, booked[i].Delay, booked[i].Reminded, want)
				}
			}
			noted, err := e.rdb.ZRangeWithScores(ctx, set, 0, -1).Result()
			if err != nil {
				t.Fatal(err)
			}
			want := booked[2].At.Add(-10 * time.Millisecond).UnixMicro()
			if len(noted) != 1 || noted[0].Member != "in80ms" || int64(noted[0].Score) != want {
				t.Fatalf("set holds %v, want only in80ms scored %d (its turn less 10ms)", noted, want)
			}
			if e.name != "cluster" {
				return
			}
			// The same booking with the set in another slot: not noted.
			other := "{elsewhere}:" + redistest.Prefix(t) + "wake"
			b, err := throttle.Book(ctx, []throttle.Claim{{Limiter: drain, Key: "q", N: 1}}, time.Time{}, time.Second,
				throttle.Remind(other, "x", 0, 0))
			if err != nil || !b.OK || b.Reminded {
				t.Fatalf("booking with the set in another slot = %+v, %v; want OK and not Reminded", b, err)
			}
			if n := e.rdb.Exists(ctx, other).Val(); n != 0 {
				t.Fatalf("the set in another slot was written")
			}
			// Claims in two slots: booked by several script runs, not noted.
			quota, _ := mustLimiter(t, e, quotaSpec)
			b, err = throttle.Book(ctx, []throttle.Claim{{Limiter: drain, Key: "q", N: 1}, {Limiter: quota, Key: "api", N: 1}}, time.Time{}, time.Second,
				remind("two-slots"))
			if err != nil || !b.OK || b.Reminded {
				t.Fatalf("booking on two slots = %+v, %v; want OK and not Reminded", b, err)
			}
			if _, err := e.rdb.ZScore(ctx, set, "two-slots").Result(); err != redis.Nil {
				t.Fatalf("a booking on two slots noted its turn (%v)", err)
			}
		})
	}
}
