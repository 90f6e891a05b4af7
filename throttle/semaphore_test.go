package throttle_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sluicehq/sluice/internal/redistest"
	"github.com/sluicehq/sluice/internal/testkit"
	"github.com/sluicehq/sluice/throttle"
)

func TestSemaphore(t *testing.T) {
	ctx := context.Background()
	for _, e := range engines(t)[1:] {
		t.Run(e.name, func(t *testing.T) {
			clock := testkit.NewClock(t0)
			sem, err := throttle.NewSemaphore(e.rdb, 3, 10*time.Second, throttle.WithClock(clock), throttle.WithPrefix(redistest.Prefix(t)))
			if err != nil {
				t.Fatal(err)
			}
			// 20 holders race for 3 slots.
			var held atomic.Int64
			var wg sync.WaitGroup
			for i := 0; i < 20; i++ {
				wg.Go(func() {
					st, err := sem.Acquire(ctx, "q", fmt.Sprint("h", i))
					if err != nil {
						t.Error(err)
					}
					if st.Held {
						held.Add(1)
					}
				})
			}
			wg.Wait()
			if held.Load() != 3 {
				t.Fatalf("%d holders got a slot, want 3", held.Load())
			}
			// h-x holds nothing: it is told when the first lease ends.
			if st, _ := sem.Acquire(ctx, "q", "late"); st.Held || st.Free != 10*time.Second || st.Holders != 3 {
				t.Fatalf("Acquire on a full semaphore = %+v, want not held, free in 10s", st)
			}
			if st, _ := sem.Renew(ctx, "q", "late"); st.Held {
				t.Fatalf("Renew of a holder without a slot = %+v", st)
			}
			// A lease that is not renewed ends: its holder died.
			holders := []string{}
			for i := 0; i < 20; i++ {
				if st, _ := sem.Renew(ctx, "q", fmt.Sprint("h", i)); st.Held {
					holders = append(holders, fmt.Sprint("h", i))
				}
			}
			clock.Set(t0.Add(6 * time.Second))
			sem.Renew(ctx, "q", holders[0])
			if err := sem.Release(ctx, "q", holders[1]); err != nil {
				t.Fatal(err)
			}
			clock.Set(t0.Add(10 * time.Second))
			if st, _ := sem.Acquire(ctx, "q", "a"); !st.Held || st.Holders != 2 {
				t.Fatalf("after one release and one lease ended: %+v, want held with 2 holders", st)
			}
			if st, _ := sem.Acquire(ctx, "q", "b"); !st.Held || st.Holders != 3 {
				t.Fatalf("second free slot: %+v, want held with 3 holders", st)
			}
			if st, _ := sem.Acquire(ctx, "q", "c"); st.Held {
				t.Fatalf("fourth holder got a slot: %+v", st)
			}
		})
	}
}

// TestSemaphoreLapsedLease (10.4): a holder whose lease ended is told so
// by Renew; it takes a free slot again, and is refused one that another
// holder took meanwhile.
func TestSemaphoreLapsedLease(t *testing.T) {
	ctx := context.Background()
	for _, e := range engines(t)[1:] {
		t.Run(e.name, func(t *testing.T) {
			clock := testkit.NewClock(t0)
			sem, err := throttle.NewSemaphore(e.rdb, 1, 10*time.Second, throttle.WithClock(clock), throttle.WithPrefix(redistest.Prefix(t)))
			if err != nil {
				t.Fatal(err)
			}
			steps := []struct {
				desc string
				at   time.Duration
				op   func(ctx context.Context, key, holder string) (throttle.SemaphoreState, error)
				who  string
				want throttle.SemaphoreState
			}{
				{"a acquires", 0, sem.Acquire, "a", throttle.SemaphoreState{Held: true, Holders: 1}},
				{"a renews in time", 5 * time.Second, sem.Renew, "a", throttle.SemaphoreState{Held: true, Holders: 1}},
				{"a renews late: the slot is free, a takes it again", 16 * time.Second, sem.Renew, "a", throttle.SemaphoreState{Held: true, Holders: 1, Lapsed: true}},
				{"b acquires once a's lease ends", 26 * time.Second, sem.Acquire, "b", throttle.SemaphoreState{Held: true, Holders: 1}},
				{"a renews late: b has the slot", 27 * time.Second, sem.Renew, "a", throttle.SemaphoreState{Holders: 1, Free: 9 * time.Second, Lapsed: true}},
			}
			for _, s := range steps {
				clock.Set(t0.Add(s.at))
				got, err := s.op(ctx, "q", s.who)
				if err != nil || got != s.want {
					t.Fatalf("%s: %+v, %v; want %+v", s.desc, got, err, s.want)
				}
			}
		})
	}
}
