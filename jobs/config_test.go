package jobs

import (
	"fmt"
	"math"
	"testing"
	"time"

	"github.com/sluicehq/sluice/throttle"
)

// TestLimitGuard (issue 20.2): a quota's guard makes what sluice books
// stricter than the upstream's rule by the jitter it absorbs: a sliding
// window counts over period + guard (75ms by default), a bucket's burst
// is lowered by the events of the guard at its rate but never below 1 (no
// guard by default), and a fixed window, the upstream's calendar window,
// is left as it is.
func TestLimitGuard(t *testing.T) {
	for _, tt := range []struct {
		desc string
		l    LimitConfig
		want throttle.Spec
	}{
		{desc: "sliding log, default guard", l: LimitConfig{Algorithm: "sliding_log", Limit: 5, Period: time.Second},
			want: throttle.Spec{Algorithm: throttle.SlidingLog, Limit: 5, Period: 1075 * time.Millisecond}},
		{desc: "sliding counter, its own guard", l: LimitConfig{Algorithm: "sliding_counter", Limit: 100, Period: time.Minute, Windows: 10, Guard: time.Second},
			want: throttle.Spec{Algorithm: throttle.SlidingCounter, Limit: 100, Period: 61 * time.Second, Windows: 10}},
		{desc: "token bucket, no guard by default", l: LimitConfig{Algorithm: "token_bucket", Limit: 10, Period: time.Second, Burst: 5},
			want: throttle.Spec{Algorithm: throttle.TokenBucket, Limit: 10, Period: time.Second, Burst: 5}},
		{desc: "token bucket, guard of 2.5 events", l: LimitConfig{Algorithm: "token_bucket", Limit: 50, Period: time.Second, Burst: 10, Guard: 50 * time.Millisecond},
			want: throttle.Spec{Algorithm: throttle.TokenBucket, Limit: 50, Period: time.Second, Burst: 7}},
		{desc: "leaky bucket, burst never below 1", l: LimitConfig{Algorithm: "leaky_bucket", Limit: 100, Period: time.Second, Burst: 2, Guard: 50 * time.Millisecond},
			want: throttle.Spec{Algorithm: throttle.LeakyBucket, Limit: 100, Period: time.Second, Burst: 1}},
		{desc: "fixed window, left as it is", l: LimitConfig{Algorithm: "fixed_window", Limit: 1000, Period: 24 * time.Hour},
			want: throttle.Spec{Algorithm: throttle.FixedWindow, Limit: 1000, Period: 24 * time.Hour}},
	} {
		t.Run(tt.desc, func(t *testing.T) {
			cfg := Config{Quotas: map[string]LimitConfig{"api": tt.l}}.Defaults()
			if errs := cfg.Validate(); len(errs) > 0 {
				t.Fatal(errs)
			}
			if got := cfg.Quotas["api"].Spec(); fmt.Sprint(got) != fmt.Sprint(tt.want) {
				t.Errorf("Spec() = %+v, want %+v", got, tt.want)
			}
		})
	}
}

// TestDefaultWaiting: unset, worker.waiting is room for the tasks back
// ahead of their turns (alwaysHold) at the unkeyed drains' rates (and the
// quotas' where a queue has no drain), from worker.concurrency to 10 times
// it; set, it stays.
func TestDefaultWaiting(t *testing.T) {
	drain := func(limit int, period time.Duration, key string) QueueConfig {
		return QueueConfig{Drain: &LimitConfig{Limit: limit, Period: period, Key: key}}
	}
	for _, c := range []struct {
		desc string
		cfg  Config
		want int
	}{
		{"no limit", Config{}, 10},
		{"a drain of 20/s: 8 places, at least concurrency", Config{Queues: map[string]QueueConfig{"q": drain(20, time.Second, "")}}, 10},
		{"a drain of 300/s sharded: 120 places, at most 10 times concurrency", Config{Queues: map[string]QueueConfig{"q": {Shards: 3, Drain: &LimitConfig{Limit: 300, Period: time.Second}}}}, 100},
		{"drains and a quota: the drains' 40 + 30 (the quota only lowers it)", Config{
			Worker: WorkerConfig{Concurrency: 50},
			Queues: map[string]QueueConfig{"a": drain(100, time.Second, ""), "b": drain(75, time.Second, "")},
			Quotas: map[string]LimitConfig{"api": {Limit: 6000, Period: time.Minute}},
		}, 70},
		{"a queue with no drain: the drain's 40, the quota's 40 too", Config{
			Worker: WorkerConfig{Concurrency: 50},
			Queues: map[string]QueueConfig{"a": drain(100, time.Second, ""), "b": {}},
			Quotas: map[string]LimitConfig{"api": {Limit: 6000, Period: time.Minute}},
		}, 80},
		{"a keyed drain counts for nothing", Config{Queues: map[string]QueueConfig{"q": drain(1000, time.Second, "payload.k")}}, 10},
		{"set, it stays", Config{Worker: WorkerConfig{Waiting: 3}, Queues: map[string]QueueConfig{"q": drain(300, time.Second, "")}}, 3},
		{"a rate beyond any int: 10 times concurrency", Config{Queues: map[string]QueueConfig{"q": drain(math.MaxInt, time.Nanosecond, "")}}, 100},
		{"bounded by maxWaiting", Config{Worker: WorkerConfig{Concurrency: 5000}, Queues: map[string]QueueConfig{"q": drain(1_000_000, time.Second, "")}}, maxWaiting},
	} {
		if got := c.cfg.Defaults().Worker.Waiting; got != c.want {
			t.Errorf("%s: worker.waiting %d, want %d", c.desc, got, c.want)
		}
	}
}
