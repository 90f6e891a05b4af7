package throttle_test

import (
	"context"
	"testing"
	"time"

	"github.com/sluicehq/sluice/internal/testkit"
	"github.com/sluicehq/sluice/throttle"
)

// TestKeptTurn: a turn booked ahead under an ID reads back at its instant,
// on each of its claims and on both engines; an ID that kept none, a turn
// booked for now (nothing is kept) and one given back read as none.
func TestKeptTurn(t *testing.T) {
	ctx := context.Background()
	for _, e := range engines(t) {
		t.Run(e.name, func(t *testing.T) {
			clock := testkit.NewClock(t0)
			drain := mustNew(t, e, drainSpec, clock, "drain")
			quota := mustNew(t, e, quotaSpec, clock, "quota")
			claims := func(id string) []throttle.Claim {
				return []throttle.Claim{{Limiter: drain, Key: "q", N: 1, ID: id}, {Limiter: quota, Key: "api", N: 1, ID: id}}
			}
			now := book(t, claims("task-0"), time.Time{}, time.Second)
			ahead := book(t, claims("task-1"), time.Time{}, time.Second)
			if now.Delay != 0 || ahead.Delay != 40*ms {
				t.Fatalf("bookings at +%v and +%v, want now and +40ms", now.Delay, ahead.Delay)
			}
			read := func(lim throttle.Limiter, key, id string) (time.Time, bool) {
				t.Helper()
				at, ok, err := throttle.KeptTurn(ctx, lim, key, id)
				if err != nil {
					t.Fatal(err)
				}
				return at, ok
			}
			for _, c := range claims("task-1") {
				if at, ok := read(c.Limiter, c.Key, "task-1"); !ok || !at.Equal(ahead.At) {
					t.Errorf("kept turn of task-1 on %s: %v, %v; want %v", c.Key, at, ok, ahead.At)
				}
			}
			if _, ok := read(drain, "q", "task-0"); ok {
				t.Error("task-0, booked for now, reads as kept")
			}
			if _, ok := read(drain, "q", "task-9"); ok {
				t.Error("task-9, never booked, reads as kept")
			}
			if err := drain.Cancel(ctx, "q", ahead.Turns[0]); err != nil {
				t.Fatal(err)
			}
			if _, ok := read(drain, "q", "task-1"); ok {
				t.Error("task-1's turn given back reads as kept")
			}
		})
	}
}
