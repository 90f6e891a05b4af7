package jobs

import (
	"context"
	"net/http"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/internal/redistest"
)

// TestAdaptiveKeys: a keyed adaptive quota learns one rate per key value,
// on a Scheduler against real Redis and the cluster: a 429 on one value
// cuts its rate and no other's, a stated limit is taken for its value, a
// value never answered books at the start; the change is a gate of the
// value's own, not a new gate set; a Scheduler started later books each
// value at its learned rate from its first task (the rates survive
// restarts); a value with an override keeps it, its answers ignored; a
// worker keeps at most maxKeys values, forgets those idle for keyIdle,
// and Redis forgets a value keyTTL after its last report.
func TestAdaptiveKeys(t *testing.T) {
	t.Parallel()
	for _, cluster := range []bool{false, true} {
		t.Run(map[bool]string{false: "redis", true: "cluster"}[cluster], func(t *testing.T) {
			t.Parallel()
			var rdb redis.UniversalClient = redistest.Client(t)
			if cluster {
				rdb = redistest.Cluster(t)
			}
			ctx := context.Background()
			queue := redistest.Queue(t, "adaptkeys")
			quota := "dest-" + queue
			file := Config{
				Queues: map[string]QueueConfig{queue: {}},
				Quotas: map[string]LimitConfig{quota: {Algorithm: "leaky_bucket", Limit: 10, Period: time.Second, Burst: 1,
					Key: "payload.dest", HashKeys: true, Overrides: map[string]LimitOverride{"pinned": {Limit: 3}},
					Adaptive: &AdaptiveConfig{Min: 2, Max: 100}}},
				Tasks: map[string]TaskConfig{"t": {Quotas: []string{quota}}},
			}
			s := newScheduler(t, rdb, file)
			limitOf := func(s *Scheduler, dest string) int {
				t.Helper()
				g := s.gates.Load().quotas[quota]
				if ov := g.overrides.of(g.limit.storedKey(dest), false); ov != nil {
					return ov.limit.Limit
				}
				return g.claimOn(dest).g.limit.Limit
			}
			report := func(dest string, ans UpstreamAnswer) {
				t.Helper()
				route := s.gates.Load().routeOf(queue, "t")
				hctx, r := s.adapt.reporterFor(ctx, route.quotas, func(*gate) string { return dest })
				if r == nil || !ReportUpstream(hctx, ans) {
					t.Fatal("no reporter in the handler's context of a task with a keyed adaptive quota")
				}
				s.adapt.report(ctx, s.Config())
			}
			for _, dest := range []string{"small", "large", "quiet"} {
				if got := limitOf(s, dest); got != 10 {
					t.Fatalf("%s books at %d before any answer, want the start, 10", dest, got)
				}
			}
			gs := s.gates.Load()
			report("small", UpstreamAnswer{Busy: true})
			report("large", UpstreamAnswer{Allowance: UpstreamAllowance(http.Header{"X-Ratelimit-Limit": {"40"}})})
			report("pinned", UpstreamAnswer{Busy: true})
			if s.gates.Load() != gs {
				t.Fatal("a key value's learned rate rebuilt the gate set; want a gate of the value's own")
			}
			for dest, want := range map[string]int{"small": 7, "large": 40, "quiet": 10, "pinned": 3} {
				if got := limitOf(s, dest); got != want {
					t.Fatalf("%s books at %d, want %d", dest, got, want)
				}
			}
			stored := file.Quotas[quota].storedKey
			rates, err := LearnedKeyRates(ctx, rdb, file.Defaults(), quota, 100)
			if err != nil {
				t.Fatal(err)
			}
			if len(rates) != 3 || rates[stored("small")].Limit != 7 || rates[stored("large")].Limit != 40 || rates[stored("quiet")].Limit != 10 {
				t.Fatalf("LearnedKeyRates = %+v, want small 7, large 40, quiet at the start, 10 (it had tasks, no answer), none for pinned (its override)", rates)
			}
			// hash_keys: the value is in no Redis key name.
			if n, _ := rdb.Exists(ctx, adaptKeyKey(quota, "small")).Result(); n != 0 {
				t.Fatal("a key value of a quota with hash_keys is in a Redis key's name")
			}
			ttl, err := rdb.TTL(ctx, adaptKeyKey(quota, stored("small"))).Result()
			if err != nil || ttl <= adaptKeyTTL-time.Minute || ttl > adaptKeyTTL {
				t.Fatalf("a key value's state expires in %v (%v), want %v", ttl, err, adaptKeyTTL)
			}

			later := newScheduler(t, rdb, file)
			if got := limitOf(later, "small"); got != 7 {
				t.Fatalf("a Scheduler started later books small at %d from its first task, want the learned 7", got)
			}

			// The bounds: at most maxKeys values kept; idle ones forgotten.
			later.adapt.maxKeys, later.adapt.keyIdle = 1, 200*time.Millisecond // small is kept already
			if got := limitOf(later, "large"); got != 10 {
				t.Fatalf("past maxKeys large books at %d, want the start, 10", got)
			}
			if n := len(later.adapt.keysOf(quota).keys); n != 1 {
				t.Fatalf("a worker keeps %d key values, want maxKeys, 1", n)
			}
			time.Sleep(300 * time.Millisecond)
			later.adapt.report(ctx, later.Config())
			later.adapt.report(ctx, later.Config()) // the first sent what the claims wanted
			if n := len(later.adapt.keysOf(quota).keys); n != 0 {
				t.Fatalf("after keyIdle a worker still keeps %d key values, want 0", n)
			}
			if _, built := later.gates.Load().quotas[quota].learned.built.Load(stored("small")); built {
				t.Fatal("an idle key value's gate is still kept")
			}
			if got := limitOf(later, "large"); got != 40 {
				t.Fatalf("once others are forgotten large books at %d, want its learned 40", got)
			}

			// Redis forgets a value keyTTL after its last report.
			s.adapt.keyTTL = time.Second
			report("small", UpstreamAnswer{})
			deadline := time.Now().Add(5 * time.Second)
			for {
				rates, err := LearnedKeyRates(ctx, rdb, file.Defaults(), quota, 100)
				if err != nil {
					t.Fatal(err)
				}
				if _, kept := rates[stored("small")]; !kept {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("small's learned rate outlived its TTL of 1 s by 4 s: %+v", rates)
				}
				time.Sleep(100 * time.Millisecond)
			}
		})
	}
}

// TestAdaptiveKeyLines: a key value's backlog line of a keyed adaptive
// quota is fed at adaptiveLineFeed times the value's learned rate once its
// controller has met the upstream's limit (a 429), at adaptive.max before
// (no learned rate yet, or one still growing by itself): a backlog over
// many values would otherwise send max - rate tasks a second round for
// each. And a worker that has not used a value for a while (its reports
// passed the value by) reads its rate again at its next task, rather than
// book on the limit it last read, which the fleet may have left.
func TestAdaptiveKeyLines(t *testing.T) {
	t.Parallel()
	rdb := redistest.Client(t)
	ctx := context.Background()
	queue := redistest.Queue(t, "adaptlines")
	quota := "dest-" + queue
	file := Config{
		Queues: map[string]QueueConfig{queue: {}},
		Quotas: map[string]LimitConfig{quota: {Algorithm: "leaky_bucket", Limit: 10, Period: time.Second, Burst: 1,
			Key: "payload.dest", Adaptive: &AdaptiveConfig{Min: 1, Max: 100}}},
		Tasks: map[string]TaskConfig{"t": {Quotas: []string{quota}}},
	}
	s, other := newScheduler(t, rdb, file), newScheduler(t, rdb, file)
	report := func(s *Scheduler, dest string, ans UpstreamAnswer) {
		t.Helper()
		route := s.gates.Load().routeOf(queue, "t")
		hctx, _ := s.adapt.reporterFor(ctx, route.quotas, func(*gate) string { return dest })
		ReportUpstream(hctx, ans)
		s.adapt.report(ctx, s.Config())
	}
	interval := func(s *Scheduler, dest string) time.Duration {
		t.Helper()
		line, ok := lineOf(queue, s.gates.Load().quotas[quota].claimOn(dest), 1)
		if !ok {
			t.Fatalf("%s has no backlog line", dest)
		}
		return time.Duration(line.interval) * time.Microsecond
	}
	if got := interval(s, "d"); got != 10*time.Millisecond {
		t.Fatalf("with no learned rate, d's line spaces tickets %v apart, want adaptive.max's 10ms", got)
	}
	report(s, "d", UpstreamAnswer{})
	if got := interval(s, "d"); got != 10*time.Millisecond {
		t.Fatalf("with a learned rate still searching, d's line spaces tickets %v apart, want adaptive.max's 10ms", got)
	}
	if got := other.gates.Load().quotas[quota].claimOn("d").g.limit.learned; got != 10 {
		t.Fatalf("the other worker books d at %v, want its learned 10", got)
	}
	report(s, "d", UpstreamAnswer{Busy: true}) // cut to 7
	want := time.Second / (adaptiveLineFeed * 7) / time.Microsecond * time.Microsecond
	if got := interval(s, "d"); got != want {
		t.Fatalf("after a 429, d's line spaces tickets %v apart, want %v (%v times its 7/s)", got, want, adaptiveLineFeed)
	}

	// The other worker heard nothing of the cut (no notice in this test),
	// and its report passes d by: no task of it for longer than a turn is
	// booked ahead.
	kr, _ := other.adapt.keyRateOf(quota, "d")
	kr.used.Store(time.Now().Add(-2 * adaptiveReserve).UnixMicro())
	kr.wanted.Store(false)
	other.adapt.report(ctx, other.Config())
	if got := other.gates.Load().quotas[quota].claimOn("d").g.limit.learned; got != 7 {
		t.Fatalf("the other worker's next task of d books at %v, want the fleet's 7 (read again, not the 10 it last read)", got)
	}
}
