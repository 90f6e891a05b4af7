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
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/internal/redistest"
	"github.com/sluicehq/sluice/internal/testkit"
)

// t0 is aligned to every period the tests use.
var t0 = time.Unix(1_800_000_000, 0)

const ms = time.Millisecond

// bookingFixture is a Scheduler on a manual clock, with a queue drained at
// 25/s (burst 1) whose task type draws on quotas, on the standalone server
// or rdb.
type bookingFixture struct {
	s      *Scheduler
	clock  *testkit.Clock
	queue  string
	quotas []string
}

// limit is a quota or drain spec for the fixtures.
func limit(algorithm string, perSecond, burst int, policy string) LimitConfig {
	return LimitConfig{Algorithm: algorithm, Limit: perSecond, Period: time.Second, Burst: burst, OnRedisError: policy}
}

func newBookingFixture(t *testing.T, rdb redis.UniversalClient, drain LimitConfig, quotas ...LimitConfig) *bookingFixture {
	t.Helper()
	f := &bookingFixture{clock: testkit.NewClock(t0), queue: redistest.Queue(t, "q")}
	cfg := Config{
		Queues: map[string]QueueConfig{f.queue: {Drain: &drain}},
		Quotas: map[string]LimitConfig{},
		Tasks:  map[string]TaskConfig{},
	}
	for i, q := range quotas {
		name := redistest.Queue(t, fmt.Sprint("api", i))
		f.quotas = append(f.quotas, name)
		cfg.Quotas[name] = q
	}
	cfg.Tasks["test:call"] = TaskConfig{Quotas: f.quotas}
	s, err := NewScheduler(rdb, asynq.RedisClientOpt{Addr: redistest.Addr(t)}, cfg,
		NewMetrics(prometheus.NewRegistry()), slog.New(slog.NewTextHandler(io.Discard, nil)), WithClock(f.clock))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	f.s = s
	return f
}

// book books a task of test:call carrying headers.
func (f *bookingFixture) book(t *testing.T, headers map[string]string) booking {
	t.Helper()
	b, err := f.s.book(context.Background(), f.s.gates.Load(), f.queue, asynq.NewTaskWithHeaders("test:call", nil, headers))
	if err != nil {
		t.Fatalf("book: %v", err)
	}
	return b
}

// readyTimes books n tasks and returns when each may run, from t0.
func (f *bookingFixture) readyTimes(t *testing.T, n int) []time.Duration {
	t.Helper()
	var got []time.Duration
	for range n {
		b := f.book(t, nil)
		if !b.askAt.IsZero() {
			t.Fatalf("booking deferred to %v", b.askAt.Sub(t0))
		}
		for _, h := range b.turns {
			if !h.Turn.At.Equal(b.ready) {
				t.Fatalf("turns %+v not all at the task's instant %v", b.turns, b.ready.Sub(t0))
			}
		}
		got = append(got, b.ready.Sub(t0))
	}
	return got
}

func durations(ms ...int) string {
	var ds []time.Duration
	for _, m := range ms {
		ds = append(ds, time.Duration(m)*time.Millisecond)
	}
	return fmt.Sprint(ds)
}

// TestBookTwoGates: a drain of 25/s and a quota of 10/s burst 5: the
// earliest instant both admit each task, 40ms apart while the quota's
// burst lasts, then at the quota's pace.
func TestBookTwoGates(t *testing.T) {
	f := newBookingFixture(t, redistest.Client(t), limit("leaky_bucket", 25, 1, "deny"), limit("token_bucket", 10, 5, "deny"))
	got := f.readyTimes(t, 12)
	if want := durations(0, 40, 80, 120, 160, 200, 240, 300, 400, 500, 600, 700); fmt.Sprint(got) != want {
		t.Fatalf("tasks ready at %v, want %v", got, want)
	}
}

// TestBookThreeGates: the drain, a quota of 10/s burst 5 and another of
// 4/s burst 2: the third binds from the third task on, 250ms apart.
func TestBookThreeGates(t *testing.T) {
	f := newBookingFixture(t, redistest.Cluster(t), limit("leaky_bucket", 25, 1, "deny"),
		limit("token_bucket", 10, 5, "deny"), limit("token_bucket", 4, 2, "deny"))
	got := f.readyTimes(t, 6)
	if want := durations(0, 40, 250, 500, 750, 1000); fmt.Sprint(got) != want {
		t.Fatalf("tasks ready at %v, want %v", got, want)
	}
}

// TestBookRedisFails: the limits' Redis is down; each policy decides.
func TestBookRedisFails(t *testing.T) {
	dead := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", MaxRetries: -1, DialTimeout: 50 * ms})
	t.Cleanup(func() { dead.Close() })
	t.Run("deny: ask again in a second, from Redis", func(t *testing.T) {
		f := newBookingFixture(t, dead, limit("leaky_bucket", 25, 1, "deny"), limit("token_bucket", 10, 5, "deny"))
		if b := f.book(t, nil); !b.askAt.Equal(t0.Add(redisRetry)) || len(b.turns) != 0 {
			t.Fatalf("booking = %+v, want to ask again at +%v with no turn", b, redisRetry)
		}
	})
	t.Run("allow: run now", func(t *testing.T) {
		f := newBookingFixture(t, dead, limit("leaky_bucket", 25, 1, "allow"), limit("token_bucket", 10, 5, "allow"))
		if got := f.readyTimes(t, 3); fmt.Sprint(got) != durations(0, 0, 0) {
			t.Fatalf("tasks ready at %v, want all now", got)
		}
	})
	t.Run("local: the limits in process", func(t *testing.T) {
		f := newBookingFixture(t, dead, limit("leaky_bucket", 25, 1, "local"), limit("token_bucket", 10, 5, "local"))
		if got, want := f.readyTimes(t, 8), durations(0, 40, 80, 120, 160, 200, 240, 300); fmt.Sprint(got) != want {
			t.Fatalf("tasks ready at %v, want %v", got, want)
		}
	})
	t.Run("one gate denies, the other allows: ask again", func(t *testing.T) {
		f := newBookingFixture(t, dead, limit("leaky_bucket", 25, 1, "allow"), limit("token_bucket", 10, 5, "deny"))
		if b := f.book(t, nil); b.askAt.IsZero() {
			t.Fatalf("booking = %+v, want to ask again: the quota's policy is deny", b)
		}
	})
}

// TestTurnGivenBack: a task that will not use its turn gives it back, and
// the next task gets it.
func TestTurnGivenBack(t *testing.T) {
	f := newBookingFixture(t, redistest.Client(t), limit("leaky_bucket", 25, 1, "deny"), limit("token_bucket", 10, 5, "deny"))
	first, second := f.book(t, nil), f.book(t, nil)
	f.s.giveBack(context.Background(), f.s.gates.Load(), f.queue, "test:call", first.turns)
	if third := f.book(t, nil); !third.ready.Equal(first.ready) {
		t.Fatalf("after the first turn (%v) was given back, the next task got %v (the second holds %v)",
			first.ready.Sub(t0), third.ready.Sub(t0), second.ready.Sub(t0))
	}
}

// TestHeldTurns: a task that comes back for its turns uses them without a
// limiter call; turns it comes back for too late, or booked under a limit
// that changed since, are booked again, and what it held is given back.
func TestHeldTurns(t *testing.T) {
	f := newBookingFixture(t, redistest.Client(t), limit("leaky_bucket", 25, 1, "deny"), limit("token_bucket", 10, 5, "deny"))
	for range 5 {
		f.book(t, nil) // turns at 0 to 160ms
	}
	waiting := f.book(t, nil) // at 200ms
	headers := map[string]string{headerTurns: writeTurns(waiting.turns)}
	calls := func() float64 { return testutil.ToFloat64(f.s.metrics.bookings) }

	before := calls()
	if b := f.book(t, headers); !b.ready.Equal(waiting.ready) || calls() != before {
		t.Fatalf("a task back for its turn at %v got %v, with %v limiter calls; want its turn, no call", waiting.ready.Sub(t0), b.ready.Sub(t0), calls()-before)
	}

	f.clock.Set(t0.Add(200*ms + lateTolerance + ms))
	late := f.book(t, headers)
	if !late.ready.Equal(f.clock.Now()) {
		t.Fatalf("a task back %v after its turn got %v; want a new turn, now", lateTolerance+ms, late.ready.Sub(t0))
	}

	// The quota changes while a task waits for its turn: it books anew, and
	// the drain's turn it held goes to the next task.
	f.clock.Set(t0.Add(time.Second))
	held := f.book(t, nil)
	next := f.book(t, nil)
	cfg := f.s.Config()
	cfg.Quotas[f.quotas[0]] = limit("token_bucket", 20, 5, "deny")
	if err := f.s.Apply(cfg); err != nil {
		t.Fatal(err)
	}
	rebooked := f.book(t, map[string]string{headerTurns: writeTurns(held.turns)})
	gs := f.s.gates.Load()
	for i, g := range gs.gatesOf(f.queue, "test:call") {
		if rebooked.turns[i].Gate != g.tag {
			t.Fatalf("rebooked turn %d is for %q, want the gate in force, %q", i, rebooked.turns[i].Gate, g.tag)
		}
	}
	if !rebooked.ready.Equal(held.ready) {
		t.Fatalf("task rebooked under the new quota at %v; want the drain turn it gave back, %v (the next task holds %v)",
			rebooked.ready.Sub(t0), held.ready.Sub(t0), next.ready.Sub(t0))
	}
}
