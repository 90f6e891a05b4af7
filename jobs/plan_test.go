package jobs

import (
	"fmt"
	"math"
	"testing"
	"time"
)

// TestPlanOf predicts, on the gates' in-process twins, what the gates in
// Redis do: a queue of 400 tasks behind a drain of 20/s (leaky bucket,
// burst 1) is empty 19.95 s after the plan's start (the first turn at once,
// then one every 50 ms), its drain busy all along; three queues behind
// drains of 5, 10 and 20/s sharing a quota of 40/s that does not bind are
// each empty when their own drain says; and the same three under a quota
// of 20/s that binds take it all, the queues in turn. Exact to the
// microsecond: the plan's clock is its own.
func TestPlanOf(t *testing.T) {
	t.Parallel()
	now := time.Unix(1_800_000_000, 0)
	tasks := func(queue, typ string, n int) []PlanTask {
		ts := make([]PlanTask, n)
		for i := range ts {
			ts[i] = PlanTask{Queue: queue, Type: typ, ID: fmt.Sprintf("%s-%d", queue, i)}
		}
		return ts
	}
	t.Run("one drain", func(t *testing.T) {
		t.Parallel()
		cfg := Config{Queues: map[string]QueueConfig{"q": {Drain: &LimitConfig{Limit: 20, Period: time.Second, Burst: 1}}}}
		plan, err := PlanOf(cfg, now, tasks("q", "http:request", 400))
		if err != nil {
			t.Fatal(err)
		}
		q := plan.Queues[0]
		if want := 19950 * time.Millisecond; q.Empty.Sub(now) != want || q.Tasks != 400 || q.FromFile != 400 {
			t.Errorf("plan %+v: empty after %v, want %v, of 400 tasks", q, q.Empty.Sub(now), want)
		}
		if q.DrainBusy == nil || *q.DrainBusy < 0.99 {
			t.Errorf("drain busy %v, want about 1", q.DrainBusy)
		}
	})
	shared := func(quota LimitConfig) Config {
		cfg := Config{
			Queues: map[string]QueueConfig{},
			Quotas: map[string]LimitConfig{"api": quota},
			Tasks:  map[string]TaskConfig{"http:request": {Quotas: []string{"api"}}},
		}
		for i, rate := range []int{5, 10, 20} {
			cfg.Queues[fmt.Sprintf("q%d", i)] = QueueConfig{Drain: &LimitConfig{Limit: rate, Period: time.Second, Burst: 1}}
		}
		return cfg
	}
	var all []PlanTask
	for i, rate := range []int{5, 10, 20} {
		all = append(all, tasks(fmt.Sprintf("q%d", i), "http:request", 10*rate)...)
	}
	t.Run("quota above the drains", func(t *testing.T) {
		t.Parallel()
		plan, err := PlanOf(shared(LimitConfig{Algorithm: "token_bucket", Limit: 40, Period: time.Second, Burst: 10}), now, all)
		if err != nil {
			t.Fatal(err)
		}
		for i, rate := range []int{5, 10, 20} {
			want := time.Duration(10*rate-1) * time.Second / time.Duration(rate)
			if got := plan.Queues[i].Empty.Sub(now); got != want {
				t.Errorf("queue of drain %d/s empty after %v, want %v", rate, got, want)
			}
		}
		if busy := plan.Quotas[0].Busy; busy == nil || *busy > 0.9 {
			t.Errorf("quota busy %v, want well below 1 (35/s of 40/s)", busy)
		}
	})
	t.Run("quota below the drains", func(t *testing.T) {
		t.Parallel()
		plan, err := PlanOf(shared(LimitConfig{Algorithm: "token_bucket", Limit: 20, Period: time.Second, Burst: 5}), now, all)
		if err != nil {
			t.Fatal(err)
		}
		// 350 tasks through 20/s after a burst of 5: 17.25 s for the last.
		if got, want := plan.Empty.Sub(now), 17250*time.Millisecond; math.Abs(float64(got-want)) > float64(100*time.Millisecond) {
			t.Errorf("all empty after %v, want about %v", got, want)
		}
		if busy := plan.Quotas[0].Busy; busy == nil || *busy < 0.99 {
			t.Errorf("quota busy %v, want about 1", busy)
		}
		for _, q := range plan.Queues {
			t.Logf("%s: %d tasks, empty after %.3f s, drain busy %.3f", q.Name, q.Tasks, q.Seconds, *q.DrainBusy)
		}
	})
}
