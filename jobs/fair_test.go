package jobs

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/sluicehq/sluice/internal/redistest"
	"github.com/sluicehq/sluice/internal/testkit"
)

// fairFixture is a Scheduler on a manual clock with one fair queue, keyed
// by payload.t, drained at a rate (leaky bucket, burst 1).
type fairFixture struct {
	s     *Scheduler
	clock *testkit.Clock
	queue string
}

func newFairFixture(t *testing.T, perSecond int, weights map[string]int) *fairFixture {
	t.Helper()
	f := &fairFixture{clock: testkit.NewClock(t0), queue: redistest.Queue(t, "fair")}
	drain := limit("leaky_bucket", perSecond, 1, "deny")
	cfg := Config{Queues: map[string]QueueConfig{f.queue: {Drain: &drain, Fairness: &FairnessConfig{Key: "payload.t", Weights: weights}}}}
	s, err := NewScheduler(redistest.Client(t), asynq.RedisClientOpt{Addr: redistest.Addr(t)}, cfg,
		NewMetrics(prometheus.NewRegistry()), slog.New(slog.NewTextHandler(io.Discard, nil)), WithClock(f.clock))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	f.s = s
	return f
}

// offer books task id of key as a task let out of its line (letOut) or
// fresh, and puts it in its key's line if its share refuses it; it reports
// whether it booked.
func (f *fairFixture) offer(t *testing.T, id, key string, letOut bool) bool {
	t.Helper()
	ctx := context.Background()
	task := asynq.NewTask("test:call", fmt.Appendf(nil, `{"t":%q}`, key))
	b, err := f.s.book(ctx, f.s.gates.Load(), f.queue, id, task, letOut)
	if err != nil {
		t.Fatal(err)
	}
	if b.askIn > 0 {
		t.Fatalf("task %s of %s deferred by %v, want booked or sent to its line", id, key, b.askIn)
	}
	if b.line == nil {
		return true
	}
	if _, err := f.s.park(ctx, f.queue, id, b.line); err != nil {
		t.Fatal(err)
	}
	return false
}

// letOut is one look of the queue's waker: the ids it lets out of the
// fair lines.
func (f *fairFixture) letOut(t *testing.T) []string {
	t.Helper()
	more, extra := f.s.gates.Load().fair[f.queue].wakeArgs()
	args := append([]any{f.s.scriptNow(), "take", wakeBatch, wakeEvery.Microseconds(), f.s.worker, wakeLease.Microseconds()}, extra...)
	reply, err := wakeScript.Run(context.Background(), f.s.rdb, append(wakeKeys(f.queue), more...), args...).Slice()
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	for i := 1; i+1 < len(reply); i += 2 {
		ids = append(ids, reply[i].(string))
	}
	return ids
}

// TestFairWeightsAtEveryRate (issue 19.9): keys vip (weight 3) and std
// (weight 1), both backlogged, on a drain of 1, 10, 20, 40 and 1,000/s:
// counted over 200 turns of the drain and 4 depths of the fair share (so
// over whole rounds of the booked future), after 2 depths and 40 turns to
// settle, vip:std bookings are 3.0 within 10% at every rate. On a manual
// clock, the fleet's part played by the test: the tasks of both keys are
// offered, those refused wait in their lines, and each turn of the drain
// the waker lets out what the shares have room for, and those book.
func TestFairWeightsAtEveryRate(t *testing.T) {
	for _, perSecond := range []int{1, 10, 20, 40, 1000} {
		t.Run(fmt.Sprintf("%d/s", perSecond), func(t *testing.T) {
			f := newFairFixture(t, perSecond, map[string]int{"vip": 3})
			turn := time.Second / time.Duration(perSecond)
			depth := f.s.gates.Load().fair[f.queue].depth
			settle := 2*depth + 40
			turns := settle + 200 + 4*depth
			keyOf := map[string]string{}
			for i := range turns {
				for _, key := range []string{"vip", "std"} {
					id := fmt.Sprint(key, "-", i)
					keyOf[id] = key
					f.offer(t, id, key, false)
				}
			}
			booked := map[string]int{}
			for i := range turns {
				f.clock.Add(turn)
				for _, id := range f.letOut(t) {
					if f.offer(t, id, keyOf[id], true) && i >= settle {
						booked[keyOf[id]]++
					}
				}
			}
			ratio := float64(booked["vip"]) / float64(max(booked["std"], 1))
			t.Logf("%d/s: vip %d, std %d, ratio %.2f", perSecond, booked["vip"], booked["std"], ratio)
			if ratio < 2.7 || ratio > 3.3 {
				t.Errorf("vip:std %d:%d = %.2f at %d/s, want 3.0 within 10%%", booked["vip"], booked["std"], ratio, perSecond)
			}
		})
	}
}
