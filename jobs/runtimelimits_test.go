package jobs

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/internal/redistest"
	"github.com/sluicehq/sluice/internal/testkit"
)

// runtimeRedis is a Redis of the test's own for runtime limits: the
// standalone server's database 7, emptied (the runtime limits' keys are
// the fleet's, not a queue's), or the cluster, where the test's gates
// have names of their own.
func runtimeRedis(t *testing.T, cluster bool) redis.UniversalClient {
	t.Helper()
	if cluster {
		return redistest.Cluster(t)
	}
	rdb := redis.NewClient(&redis.Options{Addr: redistest.Addr(t), DB: 7})
	t.Cleanup(func() { rdb.Close() })
	if err := rdb.FlushDB(context.Background()).Err(); err != nil {
		t.Fatal(err)
	}
	return rdb
}

func runtimeConfig(queue, quota string) Config {
	return Config{
		Queues: map[string]QueueConfig{queue: {Drain: &LimitConfig{Limit: 5, Period: time.Second, Burst: 2}}},
		Quotas: map[string]LimitConfig{quota: {Limit: 4, Period: time.Second, Burst: 4, Key: "payload.dest"}},
		Tasks:  map[string]TaskConfig{"t": {Quotas: []string{quota}, Cost: 2}},
	}
}

// TestRuntimeLimits: a limit set live is in force on a running worker
// within a second, on a worker started after it from the start, lapses by
// itself with --for, goes with a reset; every change is in the history
// with its reason; a key value's limit leaves the other values at the
// file's.
func TestRuntimeLimits(t *testing.T) {
	for _, cluster := range []bool{false, true} {
		name := map[bool]string{false: "redis", true: "cluster"}[cluster]
		t.Run(name, func(t *testing.T) {
			rdb := runtimeRedis(t, cluster)
			ctx := context.Background()
			queue := redistest.Queue(t, "runtime")
			quota := "api-" + queue
			file := runtimeConfig(queue, quota)
			drain := GateName{DrainGate, queue}
			s := newScheduler(t, rdb, file)
			run, stop := context.WithCancel(ctx)
			done := make(chan struct{})
			go func() { s.Run(run); close(done) }()
			t.Cleanup(func() { stop(); <-done })
			drainLimit := func(s *Scheduler) int { return s.Config().Queues[queue].Drain.Limit }

			set, err := SetLimit(ctx, rdb, file, LimitChange{Gate: drain, Limit: 25, By: "ops", Reason: "partner asked"})
			if err != nil {
				t.Fatal(err)
			}
			if set.At.IsZero() || set.By != "ops" {
				t.Fatalf("kept %+v, want its time and who", set)
			}
			testkit.WaitFor(t, time.Second, "the running worker at 25/s", func() bool { return drainLimit(s) == 25 })
			if later := newScheduler(t, rdb, file); drainLimit(later) != 25 {
				t.Fatalf("a worker started after the set drains at %d/s, want 25", drainLimit(later))
			}

			if _, err := SetLimit(ctx, rdb, file, LimitChange{Gate: GateName{QuotaGate, quota}, Key: "big.example", Limit: 20, Burst: 20, By: "ops", Reason: "raise"}); err != nil {
				t.Fatal(err)
			}
			testkit.WaitFor(t, time.Second, "big.example's own limit", func() bool {
				return s.Config().Quotas[quota].Overrides["big.example"].Limit == 20
			})
			if l := s.Config().Quotas[quota]; l.Limit != 4 || len(l.Overrides) != 1 {
				t.Fatalf("the quota is %d/s with %d overrides, want the file's 4/s and one key's", l.Limit, len(l.Overrides))
			}

			reset, err := ResetLimit(ctx, rdb, file, drain, "", "ops", "partner is fine")
			if err != nil || !reset {
				t.Fatalf("reset: %v, %v", reset, err)
			}
			testkit.WaitFor(t, time.Second, "the file's 5/s again", func() bool { return drainLimit(s) == 5 })
			if again, err := ResetLimit(ctx, rdb, file, drain, "", "ops", "twice"); err != nil || again {
				t.Fatalf("a second reset: %v, %v; want nothing to reset", again, err)
			}

			if _, err := SetLimit(ctx, rdb, file, LimitChange{Gate: drain, Limit: 2, For: time.Second, By: "ops", Reason: "incident"}); err != nil {
				t.Fatal(err)
			}
			testkit.WaitFor(t, time.Second, "the worker at 2/s", func() bool { return drainLimit(s) == 2 })
			start := time.Now()
			testkit.WaitFor(t, 3*time.Second, "the 1s override lapsed", func() bool { return drainLimit(s) == 5 })
			if took := time.Since(start); took > 1500*time.Millisecond {
				t.Fatalf("the override lapsed %v after it was seen, want about 1s", took)
			}

			history, err := LimitHistory(ctx, rdb, drain, 10)
			if err != nil {
				t.Fatal(err)
			}
			var got []string
			for _, e := range history {
				got = append(got, e.Action+" "+e.Reason)
			}
			want := []string{"set incident", "reset partner is fine", "set partner asked"}
			if strings.Join(got, "|") != strings.Join(want, "|") {
				t.Fatalf("history of %s, newest first: %q, want %q", drain, got, want)
			}
		})
	}
}

// TestRuntimeLimitRefused: a change that is malformed, names no gate, or
// would make a limit the config refuses is refused naming its field, and
// nothing is written.
func TestRuntimeLimitRefused(t *testing.T) {
	rdb := runtimeRedis(t, false)
	ctx := context.Background()
	file := runtimeConfig("q", "api")
	ok := LimitChange{Gate: GateName{DrainGate, "q"}, Limit: 10, By: "ops", Reason: "why"}
	for _, tc := range []struct {
		name   string
		change func(*LimitChange)
		field  string
		says   string
	}{
		{"unknown gate", func(c *LimitChange) { c.Gate = GateName{DrainGate, "nope"} }, "gate", "drain:q, quota:api"},
		{"key on an unkeyed gate", func(c *LimitChange) { c.Key = "x" }, "key", "not keyed"},
		{"negative limit", func(c *LimitChange) { c.Limit = -1 }, "limit", ">= 1"},
		{"nothing to set", func(c *LimitChange) { c.Limit = 0 }, "limit", "at least one"},
		{"no reason", func(c *LimitChange) { c.Reason = " " }, "reason", "why"},
		{"period too long", func(c *LimitChange) { c.Period = 48 * time.Hour }, "period", "24h"},
		{"for too short", func(c *LimitChange) { c.For = time.Millisecond }, "for", "at least 1s"},
		{"unknown algorithm", func(c *LimitChange) { c.Algorithm = "magic" }, "algorithm", "magic"},
		{"burst below a task's cost", func(c *LimitChange) {
			c.Gate, c.Limit, c.Burst = GateName{QuotaGate, "api"}, 0, 1
		}, "burst", "cost"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ch := ok
			tc.change(&ch)
			_, err := SetLimit(ctx, rdb, file, ch)
			var refused *LimitChangeError
			if !errors.As(err, &refused) || refused.Field != tc.field || !strings.Contains(err.Error(), tc.says) {
				t.Fatalf("got %v, want a refusal of %q saying %q", err, tc.field, tc.says)
			}
			if n := rdb.DBSize(ctx).Val(); n != 0 {
				t.Fatalf("%d keys written for a refused change", n)
			}
		})
	}
}

// TestImportLimits: key overrides imported at once are all in force, as
// one entry of the history; one bad line refuses them all.
func TestImportLimits(t *testing.T) {
	rdb := runtimeRedis(t, false)
	ctx := context.Background()
	file := runtimeConfig("q", "api")
	gate := GateName{QuotaGate, "api"}
	var chs []LimitChange
	for _, key := range []string{"a.example", "b.example", "c.example"} {
		chs = append(chs, LimitChange{Gate: gate, Key: key, Limit: 9})
	}
	bad := append([]LimitChange{}, chs...)
	bad = append(bad, LimitChange{Gate: gate, Key: "d.example", Limit: -3})
	err := ImportLimits(ctx, rdb, file, bad, "ops", "tiers")
	if err == nil || !strings.HasPrefix(err.Error(), "4: limit:") {
		t.Fatalf("got %v, want the 4th refused by its limit", err)
	}
	if n := rdb.DBSize(ctx).Val(); n != 0 {
		t.Fatalf("%d keys written for a refused import", n)
	}
	if err := ImportLimits(ctx, rdb, file, chs, "ops", "tiers"); err != nil {
		t.Fatal(err)
	}
	rl, err := LoadRuntimeLimits(ctx, rdb)
	if err != nil {
		t.Fatal(err)
	}
	merged := file.WithRuntimeLimits(rl, time.Now())
	if len(merged.Quotas["api"].Overrides) != 3 || merged.Quotas["api"].Overrides["b.example"].Limit != 9 {
		t.Fatalf("merged overrides %+v, want the 3 imported", merged.Quotas["api"].Overrides)
	}
	if len(file.Quotas["api"].Overrides) != 0 {
		t.Fatal("merging changed the file's config")
	}
	history, _ := LimitHistory(ctx, rdb, gate, 10)
	if len(history) != 1 || history[0].Action != "import" || history[0].Count != 3 {
		t.Fatalf("history %+v, want one import of 3", history)
	}
}

// TestRuntimeLimitHashedKey: on a limit with hash_keys, a key value set
// live (an API token) is kept by its hash: in no Redis key, field or
// value, and in force all the same; reset finds it by its value.
func TestRuntimeLimitHashedKey(t *testing.T) {
	rdb := runtimeRedis(t, false)
	ctx := context.Background()
	file := runtimeConfig("q", "api")
	l := file.Quotas["api"]
	l.HashKeys = true
	file.Quotas["api"] = l
	const token = "tok-very-secret"
	gate := GateName{QuotaGate, "api"}
	if _, err := SetLimit(ctx, rdb, file, LimitChange{Gate: gate, Key: token, Limit: 9, By: "ops", Reason: "raise"}); err != nil {
		t.Fatal(err)
	}
	for _, key := range rdb.Keys(ctx, "*").Val() {
		dump := key + fmt.Sprint(rdb.HGetAll(ctx, key).Val()) + fmt.Sprint(rdb.LRange(ctx, key, 0, -1).Val())
		if strings.Contains(dump, token) {
			t.Errorf("Redis key %s holds the token: %s", key, dump)
		}
	}
	rl, err := LoadRuntimeLimits(ctx, rdb)
	if err != nil {
		t.Fatal(err)
	}
	if got := file.WithRuntimeLimits(rl, time.Now()).Quotas["api"].Overrides[hashedKey(token)].Limit; got != 9 {
		t.Fatalf("the token's limit in force: %d, want 9", got)
	}
	if had, err := ResetLimit(ctx, rdb, file, gate, token, "ops", "done"); err != nil || !had {
		t.Fatalf("reset by the token's value: %v, %v; want it found", had, err)
	}
}
