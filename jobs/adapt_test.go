package jobs

import (
	"cmp"
	"context"
	"errors"
	"math"
	"math/rand/v2"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/internal/redistest"
)

// controller runs adapt.lua on one quota's state at instants the test
// chooses (ARGV now), with adaptive bounds 5 to 100 and a start of 30 per
// second.
type controller struct {
	t   *testing.T
	rdb redis.UniversalClient
	key string
	t0  time.Time
}

type adaptReply struct {
	rate, before, ceiling float64
	cause                 string
	limit                 int
}

func newController(t *testing.T) *controller {
	t.Helper()
	return &controller{t: t, rdb: redistest.Client(t), key: adaptKey(redistest.Queue(t, "adapt")), t0: time.Unix(1_800_000_000, 0)}
}

// report sends one tally at d after t0.
func (c *controller) report(d time.Duration, ok, busy int, stated float64, low bool) adaptReply {
	c.t.Helper()
	lowArg := "0"
	if low {
		lowArg = "1"
	}
	reply, err := adaptScript.Run(context.Background(), c.rdb, []string{c.key}, c.t0.Add(d).UnixMicro(), 5, 100, 30,
		time.Second.Microseconds(), ok, busy, strconv.FormatFloat(stated, 'f', 6, 64), lowArg, 60, "0", adaptEvery.Microseconds()).StringSlice()
	if err != nil {
		c.t.Fatal(err)
	}
	rate, _ := strconv.ParseFloat(reply[0], 64)
	before, _ := strconv.ParseFloat(reply[1], 64)
	limit, _ := strconv.Atoi(reply[4])
	ceiling, _ := strconv.ParseFloat(reply[6], 64)
	return adaptReply{rate: rate, before: before, ceiling: ceiling, cause: reply[2], limit: limit}
}

// hiddenBucket is an upstream's own limit: limit a second, a burst of a
// fifth of a second of it.
type hiddenBucket struct {
	tokens float64
	limit  float64
}

func (b *hiddenBucket) advance(dt time.Duration) {
	b.tokens = math.Min(math.Max(1, b.limit/5), b.tokens+dt.Seconds()*b.limit)
}

func (b *hiddenBucket) call() bool {
	if b.tokens >= 1 {
		b.tokens--
		return true
	}
	return false
}

// TestAdaptController: the controller alone against a simulated upstream
// whose hidden limit goes 50/s, 20/s, 50/s for 30 s each, a fleet sending
// at the limit in force (evenly, its reports every 250 ms, the limit they
// read back in force from the next step): after each phase's first 10 s
// the upstream lets through at least 90% of its limit; at most 3% of the
// calls are answered 429; the 429s of the drop to 20/s end within 3 s of
// it. The end-to-end test (test/adaptive_test.go) has the same bounds
// with real workers.
func TestAdaptController(t *testing.T) {
	t.Parallel()
	run := runPhases(t, newController(t), []upstreamPhase{{50, 30 * time.Second}, {20, 30 * time.Second}, {50, 30 * time.Second}})
	for i, got := range run.settled {
		if limit := run.phases[i].limit; got < 0.9*limit {
			t.Errorf("phase %d: %.1f successes/s after 10 s, want >= 90%% of %v", i+1, got, limit)
		}
	}
	dropEnd := run.busyUntil[1]
	t.Logf("%d of %d calls 429 (%.2f%%); the drop's 429s ended %v after it", run.busy, run.calls, 100*float64(run.busy)/float64(run.calls), dropEnd)
	if dropEnd > 3*time.Second {
		t.Errorf("the 429s the drop to 20/s began went on for %v, want <= 3s", dropEnd)
	}
	if float64(run.busy) > 0.03*float64(run.calls) {
		t.Errorf("%d of %d calls answered 429, want <= 3%%", run.busy, run.calls)
	}
}

// TestAdaptDropFleet: TestAdaptController's drop from 50/s to 20/s, seen
// by fleets of 3 and 10 workers that report in turn, whose calls' answers
// come late and whose workers put a change in force late, 20 seeds each
// (15 s a phase): the drop's 429s end within 2 s of it in every run, and
// after 10 s the phase at 20/s gets at least 90% of it. Each worker's
// first report after a cut counts calls from before it too, and right
// after the fall the upstream let more of those through (the rest of its
// burst): measured by every report since the cut, the upstream's rate came
// out 23/s, the rate was cut to 20.7/s, and the 429s went on for up to
// 2.26 s with 3 workers and 2.91 s with 10 (now 1.36 and 1.37 s; the
// end-to-end test's bound is 3 s, and CI saw 3.1 s).
func TestAdaptDropFleet(t *testing.T) {
	t.Parallel()
	phases := []upstreamPhase{{50, 15 * time.Second}, {20, 15 * time.Second}}
	for _, f := range []simFleet{{workers: 3, lag: 60 * time.Millisecond, latency: 5 * time.Millisecond}, {workers: 10, lag: 100 * time.Millisecond, latency: 20 * time.Millisecond}} {
		var worst time.Duration
		for seed := range 20 {
			f.seed = uint64(seed)
			run := f.run(t, newController(t), phases)
			worst = max(worst, run.busyUntil[1])
			if end := run.busyUntil[1]; end > 2*time.Second {
				t.Errorf("%d workers, seed %d: the drop's 429s went on for %v, want <= 2s", f.workers, seed, end)
			}
			if got := run.settled[1]; got < 0.9*20 {
				t.Errorf("%d workers, seed %d: %.1f successes/s at 20/s after 10 s, want >= 90%%", f.workers, seed, got)
			}
		}
		t.Logf("%d workers (a change in force %v late, answers %v late): the drop's 429s ended within %v in 20 runs", f.workers, f.lag, f.latency, worst)
	}
}

// TestAdaptOutageRecovers: an upstream that answers every call 429 for 5 s
// (down, or blocking the account) and then allows 50/s again: once it
// lets calls through, the rate grows back as it would with no ceiling
// known, and the phase after the outage gets at least 90% of 50/s after
// its first 10 s. A measure of the upstream's rate from the successes
// after a cut that found none takes no ceiling from them (with one taken,
// the rate climbed back by one a second: 15/s after 10 s).
func TestAdaptOutageRecovers(t *testing.T) {
	t.Parallel()
	run := runPhases(t, newController(t), []upstreamPhase{{50, 20 * time.Second}, {0, 5 * time.Second}, {50, 30 * time.Second}})
	if got := run.settled[2]; got < 0.9*50 {
		t.Errorf("after the outage: %.1f successes/s from 10 s on, want >= 90%% of 50", got)
	}
}

// upstreamPhase is a time an upstream allows limit calls a second (0: it
// refuses every call).
type upstreamPhase struct {
	limit float64
	for_  time.Duration
}

// phasesRun is what runPhases measured.
type phasesRun struct {
	phases []upstreamPhase
	// settled is each phase's successes a second after its first 10 s.
	settled []float64
	// busyUntil is, in each phase, when the 429s that came at its start
	// ended (the last before a second without one), from its start.
	busyUntil   []time.Duration
	calls, busy int
}

// runPhases runs controller c against an upstream going through phases,
// a fleet sending at the limit in force (evenly, its reports every 250 ms,
// the limit they read back in force from the next step), starting at 30/s.
func runPhases(t *testing.T, c *controller, phases []upstreamPhase) phasesRun {
	t.Helper()
	run := simFleet{workers: 1}.run(t, c, phases)
	for i, got := range run.settled {
		if phases[i].for_ > 10*time.Second {
			t.Logf("phase %d: hidden %v/s, %.1f/s after 10 s", i+1, phases[i].limit, got)
		}
	}
	return run
}

// simFleet is a fleet of workers as the controller sees it: the calls go
// out evenly at the limit in force, to the workers in turn; each call's
// answer reaches its worker latency later on average (exponentially, by a
// seeded draw); each worker tallies its answers and reports them every
// adaptEvery at its own phase (random, but 0 for a single worker); a
// changed limit is in force for the whole fleet lag after the report that
// changed it (on the other workers it comes with the fleet's notice).
type simFleet struct {
	workers      int
	lag, latency time.Duration
	seed         uint64
}

// run simulates the fleet against phases in steps of 10 ms, starting at
// 30/s.
func (f simFleet) run(t *testing.T, c *controller, phases []upstreamPhase) phasesRun {
	t.Helper()
	const step = 10 * time.Millisecond
	rng := rand.New(rand.NewPCG(f.seed, 29))
	phase := make([]time.Duration, f.workers)
	if f.workers > 1 {
		for w := range phase {
			phase[w] = time.Duration(rng.IntN(int(adaptEvery/step))) * step
		}
	}
	type answer struct {
		at     time.Duration
		worker int
		ok     bool
	}
	type change struct {
		at    time.Duration
		limit int
	}
	var answers []answer
	var changes []change
	ok, busy := make([]int, f.workers), make([]int, f.workers)
	run := phasesRun{phases: phases}
	up := &hiddenBucket{limit: phases[0].limit, tokens: phases[0].limit / 5}
	limit, latest, owed, next := 30, 30, 0.0, 0
	var at time.Duration
	for _, p := range phases {
		up.limit = p.limit
		if p.limit == 0 {
			up.tokens = 0
		}
		from := at
		settledOK := 0
		var busyUntil time.Duration
		quiet := false
		for ; at < from+p.for_; at += step {
			up.advance(step)
			for len(changes) > 0 && changes[0].at <= at {
				limit, changes = changes[0].limit, changes[1:]
			}
			for owed += float64(limit) * step.Seconds(); owed >= 1; owed-- {
				run.calls++
				allowed := up.call()
				if allowed && at >= from+10*time.Second {
					settledOK++
				}
				if !allowed {
					run.busy++
					if !quiet {
						busyUntil = at - from
					}
				}
				answers = append(answers, answer{at + time.Duration(rng.ExpFloat64()*float64(f.latency)), next, allowed})
				next = (next + 1) % f.workers
			}
			slices.SortStableFunc(answers, func(a, b answer) int { return cmp.Compare(a.at, b.at) })
			for len(answers) > 0 && answers[0].at <= at {
				if answers[0].ok {
					ok[answers[0].worker]++
				} else {
					busy[answers[0].worker]++
				}
				answers = answers[1:]
			}
			for w := range f.workers {
				if (at+step-phase[w])%adaptEvery != 0 {
					continue
				}
				r := c.report(at, ok[w], busy[w], 0, false)
				ok[w], busy[w] = 0, 0
				if r.limit != latest {
					latest = r.limit
					changes = append(changes, change{at + f.lag, r.limit})
				}
			}
			if at-from-busyUntil >= time.Second {
				quiet = true
			}
		}
		got := 0.0 // a phase of 10 s or less has no settled part
		if p.for_ > 10*time.Second {
			got = float64(settledOK) / (p.for_ - 10*time.Second).Seconds()
		}
		run.settled = append(run.settled, got)
		run.busyUntil = append(run.busyUntil, busyUntil)
	}
	return run
}

// TestAdaptiveRates: on a Scheduler, against real Redis and the cluster:
// a 429 cuts the learned rate and the quota's limit in force follows; a
// Scheduler started later books by the learned limit from the start (the
// rate survives restarts); a limit an upstream states (ReportUpstream from
// a handler's context) is taken as it is; an override set live pins the
// limit, the reports meanwhile change nothing, and after its reset the
// learned limit is back in force; the gauge shows the learned rate.
func TestAdaptiveRates(t *testing.T) {
	t.Parallel()
	for _, cluster := range []bool{false, true} {
		t.Run(map[bool]string{false: "redis", true: "cluster"}[cluster], func(t *testing.T) {
			rdb := runtimeRedis(t, cluster)
			ctx := context.Background()
			queue := redistest.Queue(t, "adaptive")
			quota := "api-" + queue
			file := Config{
				Queues: map[string]QueueConfig{queue: {}},
				Quotas: map[string]LimitConfig{quota: {Algorithm: "leaky_bucket", Limit: 30, Period: time.Second, Burst: 1, Adaptive: &AdaptiveConfig{Min: 5, Max: 100}}},
				Tasks:  map[string]TaskConfig{"t": {Quotas: []string{quota}}},
			}
			s := newScheduler(t, rdb, file)
			limit := func(s *Scheduler) int { return s.Config().Quotas[quota].Limit }
			report := func(ans UpstreamAnswer) {
				t.Helper()
				hctx, r := s.adapt.reporterFor(ctx, s.gates.Load().routeOf(queue, "t").quotas, nil)
				if r == nil || !ReportUpstream(hctx, ans) {
					t.Fatal("no reporter in the handler's context of a task with an adaptive quota")
				}
				s.adapt.report(ctx, s.Config())
			}
			if ReportUpstream(ctx, UpstreamAnswer{}) {
				t.Fatal("ReportUpstream took a report outside a task's handler")
			}
			if limit(s) != 30 {
				t.Fatalf("a new quota's limit is %d, want its start, 30", limit(s))
			}

			report(UpstreamAnswer{Busy: true})
			if limit(s) != 21 {
				t.Fatalf("after a 429 the limit in force is %d, want 30 x 0.7 = 21", limit(s))
			}
			if g := testutil.ToFloat64(s.metrics.adaptiveRate.WithLabelValues(quota)); g != 21 {
				t.Fatalf("sluice_adaptive_rate is %v, want 21", g)
			}
			if later := newScheduler(t, rdb, file); limit(later) != 21 {
				t.Fatalf("a Scheduler started later books at %d, want the learned 21", limit(later))
			}

			report(UpstreamAnswer{Allowance: UpstreamAllowance(http.Header{"Ratelimit-Policy": {`"burst";q=400;w=10`}})})
			if limit(s) != 40 {
				t.Fatalf("after the upstream stated 400 per 10 s the limit in force is %d, want 40", limit(s))
			}

			gate := GateName{QuotaGate, quota}
			if _, err := SetLimit(ctx, rdb, file, LimitChange{Gate: gate, Limit: 12, By: "ops", Reason: "the partner asked"}); err != nil {
				t.Fatal(err)
			}
			applyStored(t, s, rdb)
			if limit(s) != 12 {
				t.Fatalf("with an override of 12 the limit in force is %d", limit(s))
			}
			report(UpstreamAnswer{Busy: true})
			report(UpstreamAnswer{Allowance: &Allowance{Limit: 90, Remaining: -1}})
			if limit(s) != 12 || s.adapt.learned()[quota].Limit != 40 {
				t.Fatalf("pinned: limit %d, learned %v; want 12, and the learned 40 unchanged", limit(s), s.adapt.learned()[quota].Limit)
			}
			if _, err := ResetLimit(ctx, rdb, file, gate, "", "ops", "done"); err != nil {
				t.Fatal(err)
			}
			applyStored(t, s, rdb)
			s.adapt.report(ctx, s.Config())
			if limit(s) != 40 {
				t.Fatalf("after the reset the limit in force is %d, want the learned 40", limit(s))
			}
		})
	}
}

// applyStored puts the runtime limits stored in Redis in force on s, as
// its limits watch does.
func applyStored(t *testing.T, s *Scheduler, rdb redis.UniversalClient) {
	t.Helper()
	rl, err := LoadRuntimeLimits(context.Background(), rdb)
	if err != nil {
		t.Fatal(err)
	}
	s.applyRuntime(rl)
}

// TestUpstreamAllowance: the limits an answer's headers state, each format
// and its bounds.
func TestUpstreamAllowance(t *testing.T) {
	for _, tc := range []struct {
		desc   string
		header http.Header
		want   *Allowance
	}{
		{"none", http.Header{}, nil},
		{"current draft", http.Header{"Ratelimit-Policy": {`"default";q=100;w=60`}, "Ratelimit": {`"default";r=3;t=20`}}, &Allowance{Limit: 100, Window: time.Minute, Remaining: 3}},
		{"earlier draft, a list: the lowest rate", http.Header{"Ratelimit-Policy": {`10;w=1, 500;w=60`}, "Ratelimit-Remaining": {"7"}}, &Allowance{Limit: 500, Window: time.Minute, Remaining: 7}},
		{"earlier draft, limit only", http.Header{"Ratelimit-Limit": {"25"}}, &Allowance{Limit: 25, Remaining: -1}},
		{"X-RateLimit", http.Header{"X-Ratelimit-Limit": {"5000"}, "X-Ratelimit-Remaining": {"0"}}, &Allowance{Limit: 5000, Remaining: 0}},
		{"out of bounds", http.Header{"X-Ratelimit-Limit": {"99999999999"}, "Ratelimit-Policy": {"5;w=99999999"}}, &Allowance{Limit: 5, Remaining: -1}},
		{"malformed", http.Header{"X-Ratelimit-Limit": {"-3"}, "Ratelimit-Policy": {`"x";q=abc`}}, nil},
		{"too long", http.Header{"Ratelimit-Policy": {strings.Repeat("1;w=1,", 300)}}, nil},
	} {
		t.Run(tc.desc, func(t *testing.T) {
			got := UpstreamAllowance(tc.header)
			if (got == nil) != (tc.want == nil) || got != nil && *got != *tc.want {
				t.Fatalf("UpstreamAllowance = %+v, want %+v", got, tc.want)
			}
		})
	}
}

// TestAdaptiveConfigProblems: adaptive bounds out of range, a start outside
// them and a drain made adaptive are refused, each at its key; a keyed
// quota may be adaptive.
func TestAdaptiveConfigProblems(t *testing.T) {
	quota := func(l LimitConfig) Config {
		return Config{Quotas: map[string]LimitConfig{"api": l}}
	}
	adaptive := func(limit, lo, hi int) LimitConfig {
		return LimitConfig{Limit: limit, Period: time.Second, Adaptive: &AdaptiveConfig{Min: lo, Max: hi}}
	}
	keyed := adaptive(30, 5, 100)
	keyed.Key = "payload.dest"
	for _, tc := range []struct {
		desc string
		cfg  Config
		key  string // "" if none
	}{
		{"fine", quota(adaptive(30, 5, 100)), ""},
		{"min 0", quota(adaptive(30, 0, 100)), "quotas.api.adaptive.min"},
		{"max below min", quota(adaptive(30, 50, 40)), "quotas.api.adaptive.max"},
		{"max too high", quota(adaptive(30, 5, 2_000_000)), "quotas.api.adaptive.max"},
		{"start outside", quota(adaptive(200, 5, 100)), "quotas.api.limit"},
		{"keyed: one learned rate per key value", quota(keyed), ""},
		{"a drain", Config{Queues: map[string]QueueConfig{"q": {Drain: &LimitConfig{Limit: 5, Period: time.Second, Adaptive: &AdaptiveConfig{Min: 1, Max: 10}}}}}, "queues.q.drain.adaptive"},
	} {
		t.Run(tc.desc, func(t *testing.T) {
			var keys []string
			for _, err := range tc.cfg.Defaults().Validate() {
				var p *ConfigProblem
				if errors.As(err, &p) {
					keys = append(keys, p.Key)
				}
			}
			if tc.key == "" && len(keys) > 0 || tc.key != "" && !slices.Contains(keys, tc.key) {
				t.Fatalf("problems at %v, want one at %q", keys, tc.key)
			}
		})
	}
}

// TestAdaptProbeAfterNarrowedSearch: after a probe failed, the next
// probes go halfway to it; one that holds within 5% of it spends that
// bound, and probing starts again as after any ceiling: 4% of the ceiling,
// doubling. The controller alone, one report a second, against an upstream
// that lets 50 calls a second through and refuses the rest: the first
// raise from within 5% under the last refused rate, after that refusal, is
// at most 4% of the ceiling. The narrowed search's doubling steps were
// carried on past it: at 49.6/s under a refused 51.4/s, a raise to 53.6/s
// (8% of the ceiling), in each of the 4 searches of the run.
func TestAdaptProbeAfterNarrowedSearch(t *testing.T) {
	t.Parallel()
	c := newController(t)
	const hidden = 50.0
	var refusedAt float64 // the last rate the upstream refused calls at
	checked, firstSince := 0, false
	r := 30.0
	for at := time.Second; at <= 90*time.Second; at += time.Second {
		calls := math.Floor(r)
		ok := math.Min(calls, hidden)
		got := c.report(at, int(ok), int(calls-ok), 0, false)
		if calls > ok {
			refusedAt, firstSince = r, true
		} else if got.cause == "successes" && firstSince && got.before < refusedAt && got.before >= refusedAt/1.05 {
			firstSince = false
			checked++
			if step := got.rate - got.before; step > 0.04*got.ceiling*1.0001 {
				t.Errorf("at %v: raised from %.2f to %.2f (by %.1f%% of the ceiling %.2f), within 5%% under the refused %.2f: want at most 4%% of the ceiling",
					at, got.before, got.rate, 100*step/got.ceiling, got.ceiling, refusedAt)
			}
		}
		r = got.rate
	}
	if checked < 3 {
		t.Fatalf("%d raises from within 5%% under a refused rate in 90 s, want several to check", checked)
	}
}

// TestAdaptKnownLimitInForce: a destination allows 2 calls a second, one
// interval apart. Its rate held at 1.9/s, and a probe at 1.98/s, 2.0 in
// force, was refused: the limit is known, and what the upstream saw was
// 1.9 let through and 2.0 refused. The ceiling is halfway between those
// two limits in force, 1.95, and the rate after the cut 95% of it, 1.9 in
// force. Halfway between the controller's own rates, 1.9 and 1.98, was
// 1.94, the rate 1.84, 1.8 in force: the destination of 2/s held 90% of
// its limit for the rest of TestAdaptiveKeyedQuota (traced on 2026-12-07,
// from this very state).
func TestAdaptKnownLimitInForce(t *testing.T) {
	t.Parallel()
	rdb := redistest.Client(t)
	ctx := context.Background()
	key := adaptKey(redistest.Queue(t, "known"))
	now := time.Unix(1_800_000_000, 0).UnixMicro()
	second := time.Second.Microseconds()
	// The traced state a second after the probe's raise: the rate 1.98 (2
	// in force), raised from 1.9 (held), the ceiling 2.0, the last cut 7 s
	// ago, 2 successes in the last second.
	if err := rdb.HSet(ctx, key, "r", "1.980000", "c", "1.999469", "at", now-second, "cut", now-7*second,
		"pr", "1.900000", "l", "2", "g", now-second, "w", now-second/2, "s", 1, "sp", 1).Err(); err != nil {
		t.Fatal(err)
	}
	reply, err := adaptScript.Run(ctx, rdb, []string{key}, now, 1, 100, 10, second, 1, 1, "0.000000", "0", 60, "1",
		adaptEvery.Microseconds()).StringSlice()
	if err != nil {
		t.Fatal(err)
	}
	if reply[2] != "slow down" || reply[4] != "1.9" {
		t.Errorf("after the probe in force at 2.0 was refused, 1.9 having held: %q, rate %s, limit in force %s (ceiling %s); want a cut to 1.9 in force",
			reply[2], reply[0], reply[4], reply[6])
	}
}

// TestAdaptTenthsAsTheUpstreamSaw: where limits go in force by tenths, a
// limit is judged by the limits the upstream saw. Two states traced at a
// destination of 2/s (one interval apart), each meeting a 429:
//   - an approach to 95% of a measured ceiling of 2.1 put 2.0 in force
//     above 1.9, which had held: a probe that failed one limit in force
//     above a rate that held, so the limit is known and 1.9 goes in force.
//     It was taken as a limit that fell: 1.7 in force.
//   - a probe at 2.1 in force failed above 1.9, which had held: the rate
//     goes back to 1.9. It went to 90% of it, 1.7 in force, and the climb
//     back took 10 s of TestAdaptiveKeyedQuota's measure.
func TestAdaptTenthsAsTheUpstreamSaw(t *testing.T) {
	t.Parallel()
	rdb := redistest.Client(t)
	ctx := context.Background()
	now := time.Unix(1_800_000_000, 0).UnixMicro()
	second := time.Second.Microseconds()
	for _, tc := range []struct {
		desc                 string
		rate, ceiling, held  string
		inForce, wantInForce string
	}{
		{"an approach put 2.0 in force above 1.9, which held", "1.995950", "2.101000", "1.943000", "2", "1.9"},
		{"a probe put 2.1 in force above 1.9, which held", "2.079000", "1.943000", "1.924000", "2.1", "1.9"},
	} {
		key := adaptKey(redistest.Queue(t, "tenths"))
		// A second and a half after the raise, the last cut 5 s ago, 2
		// successes in the last second.
		if err := rdb.HSet(ctx, key, "r", tc.rate, "c", tc.ceiling, "at", now-3*second/2, "cut", now-5*second,
			"pr", tc.held, "l", tc.inForce, "g", now-3*second/2, "w", now-second/2, "s", 1, "sp", 1).Err(); err != nil {
			t.Fatal(err)
		}
		reply, err := adaptScript.Run(ctx, rdb, []string{key}, now, 1, 100, 10, second, 1, 1, "0.000000", "0", 60, "1",
			adaptEvery.Microseconds()).StringSlice()
		if err != nil {
			t.Fatal(err)
		}
		if reply[2] != "slow down" || reply[4] != tc.wantInForce {
			t.Errorf("%s, then a 429: %q, rate %s, limit in force %s (ceiling %s); want %s in force",
				tc.desc, reply[2], reply[0], reply[4], reply[6], tc.wantInForce)
		}
	}
}

// TestAdaptRaiseAfterQuietSecond: a rate is raised only after a second in
// which no worker reported a "slow down". The cut counts a burst of 429s
// once, and other workers' 429s in the second after it changed nothing;
// then one worker's report with none raised the rate (2.43 to 2.5/s in force
// at a destination of 2/s, traced in TestAdaptiveKeyedQuota).
func TestAdaptRaiseAfterQuietSecond(t *testing.T) {
	t.Parallel()
	c := newController(t)
	// 40 successes a second raise the rate; a burst of 429s at 3 s cuts it.
	for d := time.Duration(0); d < 3*time.Second; d += 250 * time.Millisecond {
		c.report(d, 10, 0, 0, false)
	}
	if cut := c.report(3*time.Second, 5, 5, 0, false); cut.cause != "slow down" {
		t.Fatalf("after 5 of 10 calls refused: %+v, want a cut", cut)
	}
	c.report(3250*time.Millisecond, 10, 0, 0, false)
	c.report(3500*time.Millisecond, 9, 1, 0, false) // another worker's 429, after the cut
	c.report(3750*time.Millisecond, 10, 0, 0, false)
	for _, d := range []time.Duration{4 * time.Second, 4250 * time.Millisecond} {
		if r := c.report(d, 10, 0, 0, false); r.cause != "" {
			t.Errorf("at %v, %v after a worker reported a 429: %+v; want no change", d, d-3500*time.Millisecond, r)
		}
	}
	if r := c.report(4500*time.Millisecond, 10, 0, 0, false); r.cause != "successes" {
		t.Errorf("a second after the last 429: %+v; want a raise", r)
	}
}

// TestAdaptFewCallsFleet: TestAdaptFewCallsProbeRarely's destinations of
// 2, 3 and 5 calls a second, their calls sent by three workers in turn,
// each reporting its own every 250 ms, a third of that apart, as
// TestAdaptiveKeyedQuota's fleet does; the calls 2 ms late on average, a
// limit in force 250 ms after the report that read it. Issue 23's measure,
// 60 seeds each: from 15 s to 35 s, at least 88% of the limit used in
// every run, 91.5% on average (now 92.0, 93.2 and 92.8%). At 2/s the code
// before used 90.1% on average and 87.5% in the worst runs: its cuts took
// the controller's own rates, not the limits the upstream saw
// (TestAdaptTenthsAsTheUpstreamSaw).
func TestAdaptFewCallsFleet(t *testing.T) {
	t.Parallel()
	rdb := redistest.Client(t)
	for _, hidden := range []float64{2, 3, 5} {
		var worst, sum float64
		const seeds = 60
		for seed := range seeds {
			settledOK, _ := fewCalls{hidden: hidden, late: 2 * time.Millisecond, lag: 250 * time.Millisecond, seed: uint64(seed),
				length: 35 * time.Second, workers: 3}.run(t, rdb)
			used := float64(settledOK) / (hidden * 20)
			sum += used
			if seed == 0 || used < worst {
				worst = used
			}
		}
		t.Logf("%v/s, 3 workers: %.1f%% of the limit used on average from 15s to 35s, %.1f%% in the worst of %d runs", hidden, 100*sum/seeds, 100*worst, seeds)
		if worst < 0.88 || sum/seeds < 0.915 {
			t.Errorf("%v/s, 3 workers: %.1f%% of the limit used on average from 15s to 35s, %.1f%% in the worst run; want at least 91.5%% and 88%%",
				hidden, 100*sum/seeds, 100*worst)
		}
	}
}

// TestAdaptFewCallsProbeOnEvidence: at 2 calls a second a second's
// success is 2 calls, too few to say a rate held: a probe went on to the
// next step (2.0 to 2.2/s in force) before the upstream had answered more
// than two calls at 2.0, which it refuses now and then (one interval
// apart, calls a few ms late). A probe's next step waits 5 calls' time at
// the rate it left (2.5 s at 2/s), or a second if longer. The controller
// alone against a destination of 2/s (a burst of 1), the fleet sending at
// the limit in force.
func TestAdaptFewCallsProbeOnEvidence(t *testing.T) {
	t.Parallel()
	rdb := redistest.Client(t)
	var last time.Duration
	probes := 0
	run := fewCalls{hidden: 2, length: 60 * time.Second, changed: func(c fewChange) {
		if c.cause == "successes" && c.before >= 0.95*c.ceiling && c.ceiling > 0 {
			probes++
			if wait := time.Duration(5 / c.before * float64(time.Second)); c.at-last < wait-time.Millisecond {
				t.Errorf("at %v: a probe step from %.2f to %.2f/s (ceiling %.2f) %v after the change before; want at least 5 calls' time, %v",
					c.at, c.before, c.rate, c.ceiling, c.at-last, wait.Round(time.Millisecond))
			}
		}
		last = c.at
	}}
	run.run(t, rdb)
	if probes < 2 {
		t.Fatalf("%d probe steps in 60 s, want some to check", probes)
	}
}

// TestAdaptNoCreep: a quota whose rate is not used (8 successes a second
// at a rate of 30) is not raised, however long the calls succeed; one that
// is used is, at most once a second.
func TestAdaptNoCreep(t *testing.T) {
	t.Parallel()
	c := newController(t)
	var r adaptReply
	for d := time.Duration(0); d < 20*time.Second; d += 250 * time.Millisecond {
		r = c.report(d, 2, 0, 0, false)
	}
	if r.rate != 30 {
		t.Fatalf("after 20 s of 8 successes a second the rate is %v, want the start, 30", r.rate)
	}
	changes := 0
	for d := 20 * time.Second; d < 23*time.Second; d += 250 * time.Millisecond {
		if r = c.report(d, 8, 0, 0, false); r.cause != "" {
			changes++
		}
	}
	if changes != 3 || r.rate <= 30 {
		t.Fatalf("3 s of 32 successes a second: %d changes, rate %v; want 3 raises", changes, r.rate)
	}
}

// TestLearnedFraction: a bucket's learned limit below 10 is put in force
// in tenths (a stated 1.8/s stays 1.8, a window's is rounded to 2), as
// tenths over ten periods at the same burst (1.8/s is 18 per 10 s, burst
// 1; a burst left to its default is a period's worth, 2); whole limits
// keep the period; the rates stay per the file's period.
func TestLearnedFraction(t *testing.T) {
	t.Parallel()
	rdb := redistest.Client(t)
	for fine, want := range map[string]string{"1": "1.8", "0": "2"} {
		reply, err := adaptScript.Run(context.Background(), rdb, []string{adaptKey(redistest.Queue(t, "fraction"+fine))}, "", 1, 100, 10,
			time.Second.Microseconds(), 0, 0, "1.800000", "0", 60, fine, adaptEvery.Microseconds()).StringSlice()
		if err != nil {
			t.Fatal(err)
		}
		if reply[4] != want {
			t.Errorf("a stated 1.8/s with fractions %s: limit in force %q, want %q", fine, reply[4], want)
		}
	}
	l := LimitConfig{Algorithm: "leaky_bucket", Limit: 10, Period: time.Second, Burst: 1, Adaptive: &AdaptiveConfig{Min: 1, Max: 100}}
	at := l.atLearned(1.8)
	if at.Limit != 18 || at.Period != 10*time.Second || at.Burst != 1 || at.RatePeriod() != time.Second || at.startRate() != 10 {
		t.Errorf("1.8/s in force as %d/%v burst %d (rates per %v, start %d); want 18/10s burst 1, per 1s, start 10", at.Limit, at.Period, at.Burst, at.RatePeriod(), at.startRate())
	}
	if err := at.Spec().Validate(); err != nil {
		t.Error(err)
	}
	if again := at.atLearned(20); again.Limit != 20 || again.Period != time.Second || again.startRate() != 10 {
		t.Errorf("20/s after 1.8/s in force as %d/%v (start %d); want 20/1s, start 10", again.Limit, again.Period, again.startRate())
	}
	l.Burst = 0
	if at := l.atLearned(1.8); at.Burst != 2 {
		t.Errorf("1.8/s of a quota with the default burst: burst %d, want 2 (a period's worth)", at.Burst)
	}
}

// TestAdaptFewCallsProbeRarely: destinations that allow 2, 3 and 5 calls
// a second one interval apart (a burst of 1), each learned by a keyed
// quota's controller (min 1, max 100, start 10, limits in tenths), the
// fleet sending at the limit in force, evenly, its reports every 250 ms.
// Each probe past such a limit is a 429, a lost call and a cut; probing 6 s
// after each cut, as at 50/s, was a probe every dozen calls at 2/s (issue
// 23's destinations of 2 and 3/s used 75 to 85% of their limits; here 6
// calls answered 429 in 45 s at each rate). From 15 s on: at most 3 calls
// answered 429 in 45 s, and at least 90% of the limit used.
func TestAdaptFewCallsProbeRarely(t *testing.T) {
	t.Parallel()
	rdb := redistest.Client(t)
	const settle, run = 15 * time.Second, 60 * time.Second
	for _, hidden := range []float64{2, 3, 5} {
		settledOK, settledBusy := fewCalls{hidden: hidden, length: run}.run(t, rdb)
		used := float64(settledOK) / (hidden * (run - settle).Seconds())
		t.Logf("%v/s: from %v on, %d successes (%.1f%% of the limit), %d answered 429", hidden, settle, settledOK, 100*used, settledBusy)
		if settledBusy > 3 {
			t.Errorf("%v/s: %d calls answered 429 in %v, want at most 3: the controller probes too often for so few calls", hidden, settledBusy, run-settle)
		}
		if used < 0.9 {
			t.Errorf("%v/s: %.1f%% of the limit used from %v on, want at least 90%%", hidden, 100*used, settle)
		}
	}
}

// TestAdaptFewCallsStartLate: TestAdaptFewCallsProbeRarely's destinations
// of 2 and 3 calls a second, the calls starting a little after their turns
// as a fleet's do (exponentially, a few ms on average), and issue 23's
// measure: the successes from 15 s to 35 s. The first 429s come at the
// starting rate of 10/s, and the controller takes the upstream's rate from
// the successes since the first cut: a second's worth at 2 or 3/s, so that
// one success that the calls' phase or a late start moved out of that
// second made it 1 or 2/s, the rate half or two thirds of the limit for the
// rest of the run (TestAdaptiveKeyedQuota's destination of 2/s used 80% of
// it after 15 s, its learned limit 0.99/s after the cut). Each run, 20
// seeds of late starts per rate and mean lateness: at least 85% used.
func TestAdaptFewCallsStartLate(t *testing.T) {
	t.Parallel()
	rdb := redistest.Client(t)
	for _, hidden := range []float64{2, 3} {
		for _, late := range []time.Duration{2 * time.Millisecond, 3 * time.Millisecond} {
			var worst float64
			for seed := range 20 {
				settledOK, _ := fewCalls{hidden: hidden, late: late, seed: uint64(seed), length: 35 * time.Second}.run(t, rdb)
				used := float64(settledOK) / (hidden * 20)
				if seed == 0 || used < worst {
					worst = used
				}
				if used < 0.85 {
					t.Errorf("%v/s, calls %v late on average, seed %d: %.0f%% of the limit used from 15s to 35s, want at least 85%%", hidden, late, seed, 100*used)
				}
			}
			t.Logf("%v/s, calls %v late on average: at least %.0f%% of the limit used from 15s to 35s in 20 runs", hidden, late, 100*worst)
		}
	}
}

// TestAdaptFewCallsLateLimit: TestAdaptFewCallsProbeRarely's destinations
// of 2, 3 and 5 calls a second, the calls 5 ms late on average, and each
// learned limit in force half a second after the report that read it, as
// a fleet's is at a few calls a second (the next call, or the one after,
// books by it): 40 seeds each, from 15 s to 35 s, at least 80% of the limit
// used in every run. A late call's lone 429 a second after a cut, when no
// rate had held since, took the ceiling from the successes of the last
// second: one, at 2/s, where a count over a second is known to one event;
// the rate went to 1.3/s and the ceiling to 1/s (on that code the worst
// runs used 75% at 2/s, 78% at 3/s and 80% at 5/s, 4 runs under 80%; now
// 82, 80 and 81%).
func TestAdaptFewCallsLateLimit(t *testing.T) {
	t.Parallel()
	rdb := redistest.Client(t)
	for _, hidden := range []float64{2, 3, 5} {
		var worst, sum float64
		for seed := range 40 {
			settledOK, _ := fewCalls{hidden: hidden, late: 5 * time.Millisecond, lag: 500 * time.Millisecond, seed: uint64(seed), length: 35 * time.Second}.run(t, rdb)
			used := float64(settledOK) / (hidden * 20)
			sum += used
			if seed == 0 || used < worst {
				worst = used
			}
			if used < 0.8 {
				t.Errorf("%v/s, seed %d: %.0f%% of the limit used from 15s to 35s, want at least 80%%", hidden, seed, 100*used)
			}
		}
		t.Logf("%v/s, the limit in force 0.5 s late: %.1f%% of the limit used on average from 15s to 35s, %.0f%% in the worst of 40 runs", hidden, 100*sum/40, 100*worst)
	}
}

// fewCalls is the fleet of TestAdaptFewCallsProbeRarely: one key value's
// controller against a hidden limit of hidden calls a second (a burst of
// 1), the calls sent at the limit in force, evenly, each starting late by
// an exponential time of mean late (seeded), for length; a limit read back
// is in force lag later (0: from the next step).
type fewCalls struct {
	hidden float64
	late   time.Duration
	lag    time.Duration
	seed   uint64
	length time.Duration
	// workers is how many workers send the calls, in turn, each
	// reporting its own every 250 ms, a third of that apart (0: one).
	workers int
	// changed, if set, is told each change of the rate.
	changed func(c fewChange)
}

// fewChange is one change of a fewCalls run's rate: when, the rate and
// the rate before, the ceiling, the limit put in force, and why.
type fewChange struct {
	at                           time.Duration
	rate, before, ceiling, limit float64
	cause                        string
	ok, busy                     int // the report's
}

// run returns the successes and the 429s from 15 s on.
func (f fewCalls) run(t *testing.T, rdb redis.UniversalClient) (settledOK, settledBusy int) {
	t.Helper()
	const settle = 15 * time.Second
	key := adaptKey(redistest.Queue(t, "fewcalls"))
	t0 := time.Unix(1_800_000_000, 0)
	rng := rand.New(rand.NewPCG(f.seed, 23))
	const step, every = time.Millisecond, 250 * time.Millisecond
	up := &hiddenBucket{limit: f.hidden, tokens: 1}
	limit, owed := 10.0, 0.0
	type change struct {
		at    time.Duration
		limit float64
	}
	var changes []change
	workers := max(1, f.workers)
	ok, busy := make([]int, workers), make([]int, workers)
	sent := 0
	var starts []time.Duration // of the calls sent, in order
	for at := time.Duration(0); at < f.length; at += step {
		up.advance(step)
		for len(changes) > 0 && changes[0].at <= at {
			limit, changes = changes[0].limit, changes[1:]
		}
		for owed += limit * step.Seconds(); owed >= 1; owed-- {
			starts = append(starts, at+time.Duration(rng.ExpFloat64()*float64(f.late)))
		}
		slices.Sort(starts)
		for len(starts) > 0 && starts[0] <= at {
			starts = starts[1:]
			w := sent % workers
			sent++
			if up.call() {
				ok[w]++
				if at >= settle {
					settledOK++
				}
			} else {
				busy[w]++
				if at >= settle {
					settledBusy++
				}
			}
		}
		for w := range workers {
			if (at+step-(time.Duration(w)*every/time.Duration(workers)).Truncate(step))%every != 0 {
				continue
			}
			reply, err := adaptScript.Run(context.Background(), rdb, []string{key}, t0.Add(at).UnixMicro(), 1, 100, 10,
				time.Second.Microseconds(), ok[w], busy[w], "0.000000", "0", 60, "1", adaptEvery.Microseconds()).StringSlice()
			if err != nil {
				t.Fatal(err)
			}
			read, err := strconv.ParseFloat(reply[4], 64)
			if err != nil {
				t.Fatal(err)
			}
			if f.changed != nil && reply[2] != "" {
				c := fewChange{at: at, limit: read, cause: reply[2], ok: ok[w], busy: busy[w]}
				c.rate, _ = strconv.ParseFloat(reply[0], 64)
				c.before, _ = strconv.ParseFloat(reply[1], 64)
				c.ceiling, _ = strconv.ParseFloat(reply[6], 64)
				f.changed(c)
			}
			changes = append(changes, change{at + f.lag, read})
			ok[w], busy[w] = 0, 0
		}
	}
	return settledOK, settledBusy
}
