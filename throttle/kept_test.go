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

// TestKeepAfter (issue 20, commands per task): with KeepAfter(d), a Book
// keeps its turn under the claims' IDs only if it is more than d away (a
// turn nearer costs no SET): booked again under the same ID, a turn not
// kept is not had back, and Cancel gives it back by what it counted. On
// each engine, the local twin agreeing.
func TestKeepAfter(t *testing.T) {
	ctx := context.Background()
	for _, e := range engines(t) {
		t.Run(e.name, func(t *testing.T) {
			clock := testkit.NewClock(t0)
			drain := mustNew(t, e, drainSpec, clock, "drain") // a turn every 40ms
			claims := func(id string) []throttle.Claim {
				return []throttle.Claim{{Limiter: drain, Key: "q", N: 1, ID: id}}
			}
			bookAfter := func(id string) throttle.Booking {
				t.Helper()
				b, err := throttle.Book(ctx, claims(id), time.Time{}, time.Second, throttle.KeepAfter(50*ms))
				if err != nil || !b.OK {
					t.Fatalf("Book %s: %+v, %v", id, b, err)
				}
				return b
			}
			kept := func(id string) bool {
				t.Helper()
				_, ok, err := throttle.KeptTurn(ctx, drain, "q", id)
				if err != nil {
					t.Fatal(err)
				}
				return ok
			}
			bookAfter("task-0")
			near, far := bookAfter("task-1"), bookAfter("task-2")
			if near.Delay != 40*ms || far.Delay != 80*ms {
				t.Fatalf("task-1 and task-2 at +%v and +%v, want +40ms and +80ms", near.Delay, far.Delay)
			}
			if kept("task-1") {
				t.Error("task-1, 40ms away, is kept under its ID; want only turns more than 50ms away kept")
			}
			if !kept("task-2") {
				t.Error("task-2, 80ms away, is not kept under its ID")
			}
			// task-1 asks again (its reply lost): a new turn, not its own.
			if again := bookAfter("task-1"); again.Kept || again.Delay != 120*ms {
				t.Errorf("task-1 booked again: %+v; want a new turn at +120ms (its first is not kept)", again)
			}
			// Its first turn given back by what it counted: the next
			// booking has it.
			if err := drain.Cancel(ctx, "q", near.Turns[0]); err != nil {
				t.Fatal(err)
			}
			if next := bookAfter("task-3"); next.Delay != 40*ms {
				t.Errorf("task-3 after task-1's first turn was given back: +%v, want its +40ms", next.Delay)
			}
		})
	}
}
