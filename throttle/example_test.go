package throttle_test

import (
	"context"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/throttle"
)

// fixedClock stands still, so the examples' output does not depend on when
// they run.
type fixedClock struct{ t time.Time }

func (c *fixedClock) Now() time.Time { return c.t }

// After: the clock stands still, so only a wait of 0 or less ends.
func (c *fixedClock) After(d time.Duration) <-chan time.Time {
	ch := make(chan time.Time, 1)
	if d <= 0 {
		ch <- c.t
	}
	return ch
}

// try calls AllowN on one key at t0+at and prints the decision.
func try(lim throttle.Limiter, clock *fixedClock, at time.Duration, n int) {
	clock.t = time.Unix(1_800_000_000, 0).Add(at)
	d, err := lim.AllowN(context.Background(), "alice", n)
	if err != nil {
		fmt.Println(err)
		return
	}
	if d.Allowed {
		fmt.Printf("+%v n=%d: allowed, %d left\n", at, n, d.Remaining)
	} else {
		fmt.Printf("+%v n=%d: denied, retry after %v\n", at, n, d.RetryAfter)
	}
}

func ExampleNew() {
	rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:6379"})
	lim, err := throttle.New(rdb, throttle.Spec{Algorithm: throttle.TokenBucket, Limit: 10, Period: time.Second})
	if err != nil {
		panic(err)
	}
	d, err := lim.AllowN(context.Background(), "api:alice", 1)
	if err != nil {
		panic(err) // Redis failed; a denial is not an error
	}
	if !d.Allowed {
		fmt.Println("come back in", d.RetryAfter)
	}
}

func Example_fixedWindow() {
	clock := &fixedClock{}
	lim, _ := throttle.NewLocal(throttle.Spec{Algorithm: throttle.FixedWindow, Limit: 3, Period: time.Second}, throttle.WithClock(clock))
	try(lim, clock, 900*time.Millisecond, 3)
	try(lim, clock, 950*time.Millisecond, 1)
	try(lim, clock, time.Second, 3) // a new window: three more at once
	// Output:
	// +900ms n=3: allowed, 0 left
	// +950ms n=1: denied, retry after 50ms
	// +1s n=3: allowed, 0 left
}

func Example_slidingLog() {
	clock := &fixedClock{}
	lim, _ := throttle.NewLocal(throttle.Spec{Algorithm: throttle.SlidingLog, Limit: 3, Period: time.Second}, throttle.WithClock(clock))
	try(lim, clock, 900*time.Millisecond, 3)
	try(lim, clock, time.Second, 1) // still three in (0s, 1s]
	try(lim, clock, 1900*time.Millisecond, 1)
	// Output:
	// +900ms n=3: allowed, 0 left
	// +1s n=1: denied, retry after 900ms
	// +1.9s n=1: allowed, 2 left
}

func Example_slidingCounter() {
	clock := &fixedClock{}
	lim, _ := throttle.NewLocal(throttle.Spec{Algorithm: throttle.SlidingCounter, Limit: 4, Period: time.Second, Windows: 4}, throttle.WithClock(clock))
	try(lim, clock, 0, 2)
	try(lim, clock, 500*time.Millisecond, 2)
	try(lim, clock, 600*time.Millisecond, 1) // the first sub-window slides out at 1s
	try(lim, clock, time.Second, 1)
	// Output:
	// +0s n=2: allowed, 2 left
	// +500ms n=2: allowed, 0 left
	// +600ms n=1: denied, retry after 400ms
	// +1s n=1: allowed, 1 left
}

func Example_tokenBucket() {
	clock := &fixedClock{}
	lim, _ := throttle.NewLocal(throttle.Spec{Algorithm: throttle.TokenBucket, Limit: 10, Period: time.Second, Burst: 5}, throttle.WithClock(clock))
	try(lim, clock, 0, 5) // starts full
	try(lim, clock, 0, 1)
	try(lim, clock, 250*time.Millisecond, 2) // 2.5 tokens back; the half is kept
	try(lim, clock, 300*time.Millisecond, 1)
	// Output:
	// +0s n=5: allowed, 0 left
	// +0s n=1: denied, retry after 100ms
	// +250ms n=2: allowed, 0 left
	// +300ms n=1: allowed, 0 left
}

func Example_leakyBucket() {
	clock := &fixedClock{}
	lim, _ := throttle.NewLocal(throttle.Spec{Algorithm: throttle.LeakyBucket, Limit: 20, Period: time.Second, Burst: 1}, throttle.WithClock(clock))
	try(lim, clock, 0, 1)
	try(lim, clock, 10*time.Millisecond, 1) // one event every 50ms, no burst
	try(lim, clock, 50*time.Millisecond, 1)
	// Output:
	// +0s n=1: allowed, 0 left
	// +10ms n=1: denied, retry after 40ms
	// +50ms n=1: allowed, 0 left
}
