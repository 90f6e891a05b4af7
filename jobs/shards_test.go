package jobs

import (
	"context"
	"log/slog"
	"math/big"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/sluicehq/sluice/internal/redistest"
	"github.com/sluicehq/sluice/producer"
)

// TestShardsConfig: queues.<q>.shards is 1 by default, from 1 to 64, and
// a sharded queue needs a bucket drain without key and no fairness; '~'
// is no queue's own. Each problem names queues.<q>.shards (or the queue).
func TestShardsConfig(t *testing.T) {
	drain := func(algorithm string) *LimitConfig {
		return &LimitConfig{Algorithm: algorithm, Limit: 300, Period: time.Second, Burst: 3}
	}
	for _, tt := range []struct {
		desc string
		q    QueueConfig
		name string
		want string // "" for none
	}{
		{desc: "default", q: QueueConfig{Drain: drain("leaky_bucket")}},
		{desc: "64 shards, token bucket", q: QueueConfig{Shards: 64, Drain: drain("token_bucket")}},
		{desc: "no drain", q: QueueConfig{Shards: 3}},
		{desc: "negative", q: QueueConfig{Shards: -1}, want: "queues.emails.shards: must be from 1 (one asynq queue, the default) to 64, got -1"},
		{desc: "too many", q: QueueConfig{Shards: 65}, want: "queues.emails.shards: must be from 1 (one asynq queue, the default) to 64, got 65"},
		{desc: "window drain", q: QueueConfig{Shards: 3, Drain: drain("sliding_log")}, want: "queues.emails.shards: needs a bucket drain (leaky_bucket or token_bucket)"},
		{desc: "keyed drain", q: QueueConfig{Shards: 3, Drain: &LimitConfig{Limit: 300, Period: time.Second, Key: "type"}}, want: "queues.emails.shards: cannot split a keyed drain"},
		{desc: "fair queue", q: QueueConfig{Shards: 2, Drain: drain("leaky_bucket"), Fairness: &FairnessConfig{Key: "type"}}, want: "queues.emails.shards: cannot split a fair queue"},
		{desc: "a tilde in a name", name: "emails~0", q: QueueConfig{}, want: `queues.emails~0: "~" is reserved for the shards of a sharded queue`},
	} {
		t.Run(tt.desc, func(t *testing.T) {
			name := tt.name
			if name == "" {
				name = "emails"
			}
			cfg := Config{Queues: map[string]QueueConfig{name: tt.q}}.Defaults()
			errs := cfg.Validate()
			switch {
			case tt.want == "" && len(errs) > 0:
				t.Fatalf("Validate() = %v, want no problem", errs)
			case tt.want != "" && (len(errs) != 1 || !strings.HasPrefix(errs[0].Error(), tt.want)):
				t.Fatalf("Validate() = %v, want one problem starting %q", errs, tt.want)
			}
			if tt.want == "" && cfg.Queues[name].Shards < 1 {
				t.Errorf("Shards after Defaults = %d, want at least 1", cfg.Queues[name].Shards)
			}
		})
	}
}

// TestShardedRates: a sharded queue is its shards, whose drains' rates add
// up to the queue's exactly (as fractions) whatever shards are busy; an
// idle shard keeps one unit of n·1000, the busy ones share the rest, and
// all have their equal share when none or all are busy. The burst is split
// (each at least 1), the priorities keep the queue's weight against the
// others, the sharded config is valid, and a queue of 1 shard is as it was.
func TestShardedRates(t *testing.T) {
	const rate = 300
	cfg := Config{Queues: map[string]QueueConfig{
		"bulk":  {Shards: 3, Priority: 2, Drain: &LimitConfig{Algorithm: "leaky_bucket", Limit: rate, Period: time.Second, Burst: 4}},
		"other": {Priority: 3, Drain: &LimitConfig{Algorithm: "leaky_bucket", Limit: 10, Period: time.Second, Burst: 1}},
	}}.Defaults()
	for _, busy := range [][]bool{nil, {true, true, true}, {false, false, false}, {true, true, false}, {false, true, false}} {
		s := cfg.sharded(map[string][]bool{"bulk": busy})
		if errs := s.Validate(); len(errs) > 0 {
			t.Fatalf("busy %v: the sharded config is refused: %v", busy, errs)
		}
		names := producer.ShardQueues("bulk", 3)
		if got := sortedKeys(s.Queues); !slices.Equal(got, slices.Sorted(slices.Values(append([]string{"other"}, names...)))) {
			t.Fatalf("busy %v: queues %v, want other and bulk's shards %v", busy, got, names)
		}
		total := new(big.Rat)
		var rates []*big.Rat
		bursts, weight := 0, 0
		for i, name := range names {
			q := s.Queues[name]
			if q.shardOf != "bulk" {
				t.Errorf("%s: shardOf %q, want bulk", name, q.shardOf)
			}
			r := big.NewRat(int64(q.Drain.Limit)*int64(time.Second), int64(q.Drain.Period))
			rates = append(rates, r)
			total.Add(total, r)
			bursts += q.Drain.Burst
			weight += q.Priority
			idle := busy != nil && !busy[i] && slices.Contains(busy, true)
			if unit := big.NewRat(rate, 3*shareUnit); idle && r.Cmp(unit) != 0 {
				t.Errorf("busy %v: idle shard %d drains at %v/s, want one unit, %v/s", busy, i, r, unit)
			}
		}
		if total.Cmp(big.NewRat(rate, 1)) != 0 {
			t.Errorf("busy %v: the shards' rates %v add up to %v/s, want %d/s exactly", busy, rates, total, rate)
		}
		if bursts != 4 {
			t.Errorf("busy %v: the shards' bursts add up to %d, want the queue's 4", busy, bursts)
		}
		// Priorities scaled by 3: bulk's shards weigh 2·3 together, other 3·3.
		if other := s.Queues["other"].Priority; weight != 6 || other != 9 {
			t.Errorf("busy %v: bulk's shards weigh %d together and other %d, want 6 and 9", busy, weight, other)
		}
		if busy != nil && slices.Contains(busy, true) && slices.Contains(busy, false) {
			for i := range names {
				if busy[i] && rates[i].Cmp(big.NewRat(rate, 3)) <= 0 {
					t.Errorf("busy %v: busy shard %d drains at %v/s, want more than an equal share", busy, i, rates[i])
				}
			}
		}
	}
	one := Config{Queues: map[string]QueueConfig{"q": {Drain: cfg.Queues["other"].Drain}}}.Defaults()
	if s := one.sharded(nil); len(s.Queues) != 1 || s.Queues["q"].Drain != one.Queues["q"].Drain || s.Queues["q"].Priority != 1 {
		t.Errorf("a config without shards, sharded: %+v, want it as it was", s.Queues)
	}
}

// TestShareKeeper: with tasks in two of three shards on real Redis, the
// worker that looks stores which shards are busy, and once the third has
// been idle for shareIdleAfter its share goes to the others: the
// Scheduler puts the new rates in force (one unit for the idle shard);
// a task in it makes it busy again at the next look.
func TestShareKeeper(t *testing.T) {
	rdb := redistest.Client(t)
	queue := redistest.Queue(t, "shares")
	cfg := Config{Queues: map[string]QueueConfig{queue: {Shards: 3, Drain: &LimitConfig{Algorithm: "leaky_bucket", Limit: 300, Period: time.Second, Burst: 3}}}}
	s, err := NewScheduler(rdb, asynq.RedisClientOpt{Addr: redistest.Addr(t)}, cfg, NewMetrics(prometheus.NewRegistry()), slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	names := producer.ShardQueues(queue, 3)
	client := asynq.NewClient(asynq.RedisClientOpt{Addr: redistest.Addr(t)})
	defer client.Close()
	var last *asynq.TaskInfo
	for _, shard := range names {
		if last, err = client.Enqueue(asynq.NewTask("t", nil), asynq.Queue(shard)); err != nil {
			t.Fatal(err)
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { s.Run(ctx); close(done) }()
	defer func() { cancel(); <-done }()

	rateOf := func(shard string) *big.Rat {
		d := s.Config().Queues[shard].Drain
		return big.NewRat(int64(d.Limit)*int64(time.Second), int64(d.Period))
	}
	waitFor := func(what string, cond func() bool) {
		t.Helper()
		deadline := time.Now().Add(5 * time.Second)
		for !cond() {
			if time.Now().After(deadline) {
				t.Fatalf("no %s within 5s: busy %q, rates %v %v %v", what, rdb.HGet(ctx, sharesKey(queue), "busy").Val(),
					rateOf(names[0]), rateOf(names[1]), rateOf(names[2]))
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	waitFor("every shard busy", func() bool { return rdb.HGet(ctx, sharesKey(queue), "busy").Val() == "111" })
	inspector := asynq.NewInspector(asynq.RedisClientOpt{Addr: redistest.Addr(t)})
	defer inspector.Close()
	if err := inspector.DeleteTask(names[2], last.ID); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	waitFor("shares for shards 0 and 1", func() bool { return rateOf(names[0]).Cmp(big.NewRat(150, 1)) == 0 })
	if d := time.Since(start); d < shareIdleAfter-shareLook {
		t.Errorf("the idle shard's share went after %v, want after about shareIdleAfter (%v): it had tasks a moment before", d, shareIdleAfter)
	}
	if got, want := rateOf(names[2]), big.NewRat(300, 3*shareUnit); got.Cmp(want) != 0 {
		t.Errorf("the idle shard drains at %v/s, want one unit, %v/s", got, want)
	}
	if _, err := client.Enqueue(asynq.NewTask("t", nil), asynq.Queue(names[2])); err != nil {
		t.Fatal(err)
	}
	waitFor("equal shares again", func() bool { return rateOf(names[2]).Cmp(big.NewRat(100, 1)) == 0 })
}
