package throttle_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/sluicehq/sluice/throttle"
)

// TestLiveChangeKeepsWhatWasUsed (issue 20.4), on every engine and
// algorithm: a key of a limit of 2 per second used once now and once 400
// ms ahead under an ID; 100 ms later the limit changes (WithStateOf).
// Raised to 10 per second, the turn booked under the ID at the old limit
// is not kept but booked again (its old one given back), now: the windows
// then have 8 left of 10 (a fresh key 10), the buckets 5 (the first event
// took 0.5 s of server time at the old rate, 0.4 s of it still ahead, the
// rebooked one 0.1 s at the new: 0.5 s of the new 1 s window). Cut to 1
// per second: nothing until what was counted has passed, the turn booked
// ahead included until its task books again: 900 ms on for fixed_window
// and the buckets (the old window; the old server time), 1.3 s for the
// sliding windows (past the turn at 400 ms); a fresh key gets 1 now.
func TestLiveChangeKeepsWhatWasUsed(t *testing.T) {
	ctx := context.Background()
	forEach(t, func(t *testing.T, e engine, a throttle.Algorithm) {
		for _, cut := range []bool{false, true} {
			old := throttle.Spec{Algorithm: a, Limit: 2, Period: time.Second, Burst: 2}
			lim, clock := mustLimiter(t, e, old)
			key := "k"
			if cut {
				key = "c"
			}
			if d := allow(t, lim, key, 1); !d.Allowed {
				t.Fatalf("first event refused: %+v", d)
			}
			booked, err := throttle.Book(ctx, []throttle.Claim{{Limiter: lim, Key: key, N: 1, ID: "task"}}, clock.Now().Add(400*time.Millisecond), time.Second)
			if err != nil || !booked.OK {
				t.Fatalf("booking ahead under the old limit: %+v, %v", booked, err)
			}
			clock.Add(100 * time.Millisecond)
			changed := throttle.Spec{Algorithm: a, Limit: 10, Period: time.Second, Burst: 10}
			if cut {
				changed.Limit, changed.Burst = 1, 1
			}
			now, err := e.new(changed, throttle.WithClock(clock), throttle.WithStateOf(lim))
			if err != nil {
				t.Fatal(err)
			}
			if cut {
				want := 900 * time.Millisecond
				if a == throttle.SlidingLog || a == throttle.SlidingCounter {
					want = 1300 * time.Millisecond
				}
				if d := allow(t, now, key, 1); d.Allowed || d.RetryAfter != want {
					t.Errorf("cut to 1/s: %+v, want refused for %v", d, want)
				}
				if d := allow(t, now, "fresh", 1); !d.Allowed {
					t.Errorf("cut to 1/s: a fresh key refused: %+v", d)
				}
				continue
			}
			rebooked, err := throttle.Book(ctx, []throttle.Claim{{Limiter: now, Key: key, N: 1, ID: "task"}}, time.Time{}, time.Second)
			if err != nil || !rebooked.OK || rebooked.Kept {
				t.Errorf("the turn booked under the old limit, booked again: %+v, %v; want booked anew, not kept", rebooked, err)
			}
			wantRoom := 8
			if a == throttle.TokenBucket || a == throttle.LeakyBucket {
				wantRoom = 5
			}
			if level, err := now.(throttle.Reserver).Peek(ctx, key); err != nil || level.Remaining != wantRoom {
				t.Errorf("raised to 10/s: room %d (%v), want %d", level.Remaining, err, wantRoom)
			}
			if level, _ := now.(throttle.Reserver).Peek(ctx, "fresh"); level.Remaining != 10 {
				t.Errorf("raised to 10/s: a fresh key has room %d, want 10", level.Remaining)
			}
		}
		other := throttle.Spec{Algorithm: a, Limit: 3, Period: 7 * time.Millisecond, Burst: 1, Windows: 7}
		lim, _ := mustLimiter(t, e, throttle.Spec{Algorithm: a, Limit: 2, Period: time.Second, Burst: 2})
		if _, err := e.new(other, throttle.WithStateOf(lim)); a != throttle.SlidingLog && !errors.Is(err, throttle.ErrInvalidSpec) {
			t.Errorf("WithStateOf across layouts: %v, want ErrInvalidSpec", err)
		}
	})
}
