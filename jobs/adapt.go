package jobs

import (
	"context"
	"fmt"
	"maps"
	"math"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/lua"
	"github.com/sluicehq/sluice/throttle"
)

// An adaptive quota (quotas.<name>.adaptive) learns its upstream's real
// limit from the answers its calls get: one rate for the whole fleet, kept
// in Redis and moved by adapt.lua, the controller, from every worker's
// reports (docs/adaptive.md). A worker sends what its handlers saw (calls
// that succeeded, 429s and 503s, limits the upstream stated) every
// adaptEvery, and gets the rate back; when the rate, rounded, is not the
// limit in force, the worker puts the config in force again with the
// learned limit in the quota's place (Scheduler.applyAdaptive). A runtime
// limit set live on the quota (enqueue limits set) pins it: the learned
// rate waits, unchanged, until the override is reset or lapses.
const (
	// adaptEvery is how often a worker reports to the controllers and reads
	// the learned rates: a cut reaches every worker within twice it.
	adaptEvery = 250 * time.Millisecond
	// adaptTTL is how long a learned rate outlives the quota's last report:
	// a fleet stopped for a deploy starts again where it was.
	adaptTTL = 7 * 24 * time.Hour
	// adaptiveBlockOver: a Retry-After up to this long does not block an
	// adaptive quota fleet-wide (the rate is cut instead, and the task that
	// was refused waits it out); a longer one (maintenance) does.
	adaptiveBlockOver = 5 * time.Second
	// adaptLogEvery: a worker logs a quota's rate changes at most this
	// often.
	adaptLogEvery = time.Second
	// adaptiveReserve is the furthest ahead a task of an adaptive quota
	// books a turn (worker.reserve_max for the others): a turn is booked at
	// the rate of its instant, and a fleet booked a minute ahead would go
	// on at the old rate for that minute, whatever it learns meanwhile.
	// Further tasks wait in the quota's backlog line (backlog.go).
	adaptiveReserve = 3 * time.Second
)

var adaptScript = redis.NewScript(lua.Adapt)

// adaptedNotice is published on blockChannel by the worker whose report
// changed a learned rate: every worker reads the rates at once, so that the
// fleet changes over within milliseconds. (Workers on two versions of a
// limit each admit at their own: for up to adaptEvery, the fleet would
// admit at the sum of both rates.) No block's announcement reads so.
const adaptedNotice = "adapted"

// adaptKey is an adaptive quota's learned rate and controller state.
func adaptKey(quota string) string { return throttle.Key("sluice:adapt:", quota) }

// LearnedRate is an adaptive quota's rate as the fleet learned it.
type LearnedRate struct {
	Rate float64 // events per the quota's period
	// Limit is Rate rounded, the limit put in force: in whole events per
	// period, or in tenths below 10 for a bucket (LimitConfig.atLearned).
	Limit float64
	// Since is when Limit was set, on Redis's clock: the generation of the
	// limit's state (LimitConfig.stateVersion), the same in every worker.
	Since time.Time
	// Searching: the controller has met no limit of the upstream yet (no
	// "slow down", no stated limit): it raises the rate by itself while
	// its calls succeed.
	Searching bool
	// changed: this report changed the rate (a worker's own report).
	changed bool
}

// upstreamTally is what the handlers of one worker saw of one quota's
// upstream since the last report.
type upstreamTally struct {
	ok, busy atomic.Int64
	low      atomic.Bool
	// stated is the lowest limit per the quota's period an upstream stated
	// (math.Float64bits; 0: none).
	stated atomic.Uint64
}

// adaptiveRates is a worker's side of the adaptive quotas: it tallies the
// handlers' reports, sends them to the controllers and keeps the learned
// rates as last read.
type adaptiveRates struct {
	fleetDeps
	gauge *prometheus.GaugeVec
	// changed is called when a learned limit is not the one in force.
	changed func()
	// pinned reports whether a runtime limit pins the quota now.
	pinned func(quota string) bool

	poked   chan struct{} // report now: a learned rate changed
	tallies sync.Map      // quota -> *upstreamTally
	keyed   sync.Map      // keyed quota -> *quotaKeys (adaptkeys.go)
	// The bounds of the key values kept (adaptkeys.go): maxAdaptiveKeys,
	// adaptKeyIdle and adaptKeyTTL, but for tests.
	maxKeys int
	keyIdle time.Duration
	keyTTL  time.Duration
	mu      sync.Mutex
	rates   map[string]LearnedRate // by quota, as last read
	logGate throttle.Limiter
}

func newAdaptiveRates(deps fleetDeps, m *Metrics) *adaptiveRates {
	a := &adaptiveRates{fleetDeps: deps, gauge: m.adaptiveRate, rates: map[string]LearnedRate{}, poked: make(chan struct{}, 1),
		maxKeys: maxAdaptiveKeys, keyIdle: adaptKeyIdle, keyTTL: adaptKeyTTL}
	a.logGate, _ = throttle.NewLocal(throttle.Spec{Algorithm: throttle.SlidingLog, Limit: 1, Period: adaptLogEvery})
	return a
}

func (a *adaptiveRates) run(ctx context.Context) {
	tick := time.NewTicker(adaptEvery)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		case <-a.poked:
		}
		a.report(ctx, a.gates().cfg)
	}
}

// poke makes run report now.
func (a *adaptiveRates) poke() {
	select {
	case a.poked <- struct{}{}:
	default:
	}
}

// learned is a copy of the learned rates as last read.
func (a *adaptiveRates) learned() map[string]LearnedRate {
	a.mu.Lock()
	defer a.mu.Unlock()
	return maps.Clone(a.rates)
}

// report sends every adaptive quota of cfg its tally and reads its rate
// back (a keyed quota's, each of its key values in use: reportKeys); if a
// learned limit is not the one in force, it calls changed.
func (a *adaptiveRates) report(ctx context.Context, cfg Config) {
	stale, changed := false, false
	gs := a.gates()
	for _, name := range sortedKeys(cfg.Quotas) {
		l := cfg.Quotas[name]
		if l.Adaptive == nil {
			continue
		}
		if l.Key != "" {
			var learned *learnedGates
			if gs != nil && gs.quotas[name] != nil {
				learned = gs.quotas[name].learned
			}
			changed = a.reportKeys(ctx, name, l, learned) || changed
			continue
		}
		var t tallied
		if v, found := a.tallies.Load(name); found {
			t = v.(*upstreamTally).take()
		}
		if a.pinned(name) {
			t = tallied{} // what the pinned limit met says nothing of the learned one
		}
		lr, ok := a.send(ctx, name, l, t)
		if !ok {
			continue
		}
		if lr.Limit != l.learned && !a.pinned(name) {
			stale = true
			changed = changed || lr.changed
		}
	}
	if changed {
		if err := a.rdb.Publish(ctx, blockChannel, adaptedNotice).Err(); err != nil {
			a.log.Warn("cannot tell the fleet of a learned rate's change", "err", err)
		}
	}
	if stale && a.changed != nil {
		a.changed()
	}
}

// send runs the controller of quota l (name) with one tally; false if Redis
// did not answer (the tally is lost: the next one counts).
func (a *adaptiveRates) send(ctx context.Context, name string, l LimitConfig, t tallied) (LearnedRate, bool) {
	reply, err := adaptScript.Run(ctx, a.rdb, []string{adaptKey(name)}, adaptArgs(a.clock.scriptNow(), l, t, adaptTTL)...).StringSlice()
	lr, cause, ok := parseAdapt(reply)
	if err != nil || !ok {
		if ctx.Err() == nil {
			if d, _ := a.logGate.AllowN(context.Background(), "redis", 1); d.Allowed {
				a.log.Warn("cannot report to an adaptive quota's controller; its rate in force stays", "quota", name, "err", err)
			}
		}
		return LearnedRate{}, false
	}
	a.mu.Lock()
	a.rates[name] = lr
	a.mu.Unlock()
	a.gauge.WithLabelValues(name).Set(lr.Rate)
	if cause != "" {
		before, _ := strconv.ParseFloat(reply[1], 64)
		if d, _ := a.logGate.AllowN(context.Background(), "quota:"+name, 1); d.Allowed {
			a.log.Info("adaptive quota: rate changed", "quota", name, "from", round2(before), "to", round2(lr.Rate),
				"cause", cause, "recent_successes", reply[3], "per", l.Period)
		}
	}
	return lr, true
}

// startRate is an adaptive quota's starting rate: its file's limit (a
// learned limit merged in its place is not the start).
func (l LimitConfig) startRate() int {
	if l.filed != nil {
		return l.filed.limit
	}
	return l.Limit
}

// RatePeriod is the period an adaptive quota's rates are per: its file's
// (a learned limit with a fraction is put in force over ten of them).
func (l LimitConfig) RatePeriod() time.Duration {
	if l.filed != nil {
		return l.filed.period
	}
	return l.Period
}

// atLearned is adaptive quota l, as in its file, with a learned limit in
// force, within [Min, Max]: in whole events per period, or one with a
// fraction (a bucket's below 10: adapt.lua) in tenths over ten periods at
// the same burst, so that 1.8/s is 18 per 10 s, one event every 556 ms.
// Rounded to whole events, a destination allowing 2/s would get 1/s, or
// all of its 2/s and a 429 for every call a few ms early.
func (l LimitConfig) atLearned(limit float64) LimitConfig {
	limit = min(max(limit, float64(l.Adaptive.Min)), float64(l.Adaptive.Max))
	at := l
	if at.filed == nil {
		at.filed = &filedRate{limit: l.Limit, burst: l.Burst, period: l.Period}
	}
	at.Burst, at.Period, at.learned = at.filed.burst, at.filed.period, limit
	if whole := math.Round(limit); math.Abs(limit-whole) < 1e-6 {
		at.Limit = int(whole)
		return at
	}
	if at.Burst == 0 {
		at.Burst = max(1, int(math.Round(limit))) // 0 means Limit: a period's worth, not ten periods'
	}
	at.Limit, at.Period = int(math.Round(limit*10)), at.Period*10
	return at
}

func round2(x float64) float64 { return math.Round(x*100) / 100 }

// tally is quota's tally in this worker.
func (a *adaptiveRates) tally(quota string) *upstreamTally {
	if v, ok := a.tallies.Load(quota); ok {
		return v.(*upstreamTally)
	}
	v, _ := a.tallies.LoadOrStore(quota, new(upstreamTally))
	return v.(*upstreamTally)
}

// note adds one answer to the tallies of a task's adaptive quotas.
func (a *adaptiveRates) note(targets []adaptTarget, ans UpstreamAnswer) {
	for _, t := range targets {
		if t.g.expr != nil {
			a.noteKey(t.g, t.stored, ans)
			continue
		}
		a.tally(t.g.key).add(t.g.limit, ans)
	}
}

// add counts one answer of an upstream of quota l.
func (t *upstreamTally) add(l LimitConfig, ans UpstreamAnswer) {
	switch {
	case ans.Busy:
		t.busy.Add(1)
	default:
		t.ok.Add(1)
	}
	al := ans.Allowance
	if al == nil || al.Limit <= 0 {
		return
	}
	window := al.Window
	if window <= 0 {
		window = l.Period
	}
	perPeriod := float64(al.Limit) * float64(l.Period) / float64(window)
	for {
		old := t.stated.Load()
		if was := math.Float64frombits(old); was != 0 && was <= perPeriod {
			break
		}
		if t.stated.CompareAndSwap(old, math.Float64bits(perPeriod)) {
			break
		}
	}
	if al.Remaining >= 0 && al.Remaining*50 <= al.Limit {
		t.low.Store(true) // 2% or less left
	}
}

// mergeLearned puts the learned limits in place of the adaptive quotas'
// limits in c, except on quotas a runtime limit pins; c's Quotas map must
// be its own.
func mergeLearned(c Config, learned map[string]LearnedRate, pinned func(string) bool) Config {
	for name, lr := range learned {
		l, ok := c.Quotas[name]
		if !ok || l.Adaptive == nil || l.Key != "" || pinned(name) || lr.Limit < 1 {
			continue
		}
		l = l.atLearned(lr.Limit)
		l.generation = max(l.generation, lr.Since.UnixMicro())
		c.Quotas[name] = l
	}
	return c
}

// reporterKey carries a task's reporter in its handler's context.
type reporterKey struct{}

// upstreamReporter takes a handler's reports for its task's adaptive
// quotas.
type upstreamReporter struct {
	rates    *adaptiveRates
	targets  []adaptTarget
	reported atomic.Bool // the handler reported: its return is not counted again
}

// adaptTarget is an adaptive quota a task drew on, and for a keyed one the
// task's key value as the quota keeps it.
type adaptTarget struct {
	g      *gate
	stored string
}

// UpstreamAnswer is what one call to an upstream answered, as a handler
// tells its task's adaptive quotas (ReportUpstream).
type UpstreamAnswer struct {
	// Busy: the upstream said "slow down" (a 429 or 503). False: the call
	// got through.
	Busy bool
	// Allowance is what the upstream stated of its limit, if anything
	// (UpstreamAllowance reads it from an answer's headers).
	Allowance *Allowance
}

// ReportUpstream tells the adaptive quotas of the task whose handler ctx
// is what one call to their upstream answered. A handler that reports
// makes one report per call; one that does not is counted by what it
// returns (nil: a success; an *UpstreamBusyError: busy). It reports
// whether ctx is a sluice task's with an adaptive quota.
func ReportUpstream(ctx context.Context, ans UpstreamAnswer) bool {
	r, _ := ctx.Value(reporterKey{}).(*upstreamReporter)
	if r == nil {
		return false
	}
	r.reported.Store(true)
	r.rates.note(r.targets, ans)
	return true
}

// reporterFor returns ctx carrying a reporter for a task that draws on
// quotas, if any of them is adaptive, and the reporter (nil if none).
// keyOf gives the task's key value on a keyed quota.
func (a *adaptiveRates) reporterFor(ctx context.Context, quotas []*gate, keyOf func(*gate) string) (context.Context, *upstreamReporter) {
	var targets []adaptTarget
	for _, g := range quotas {
		if g.limit.Adaptive == nil {
			continue
		}
		t := adaptTarget{g: g}
		if g.expr != nil {
			t.stored = g.limit.storedKey(keyOf(g))
		}
		targets = append(targets, t)
	}
	if targets == nil {
		return ctx, nil
	}
	r := &upstreamReporter{rates: a, targets: targets}
	return context.WithValue(ctx, reporterKey{}, r), r
}

// returned counts what the handler returned, unless it reported itself:
// nil is a success, busy a "slow down"; any other error says nothing of
// the upstream's limit.
func (r *upstreamReporter) returned(err error, busy *UpstreamBusyError) {
	if r == nil || r.reported.Load() {
		return
	}
	switch {
	case busy != nil:
		r.rates.note(r.targets, UpstreamAnswer{Busy: true})
	case err == nil:
		r.rates.note(r.targets, UpstreamAnswer{})
	}
}

// LearnedRates reads the learned rates of cfg's adaptive quotas (those
// with none yet are left out), and returns cfg with them in force as the
// workers have them: the learned limit in place of each adaptive quota's,
// except where a runtime limit in rl pins it at now. It changes nothing.
func LearnedRates(ctx context.Context, rdb redis.UniversalClient, cfg Config, rl []RuntimeLimit, now time.Time) (Config, map[string]LearnedRate, error) {
	rates := map[string]LearnedRate{}
	for _, name := range sortedKeys(cfg.Quotas) {
		if cfg.Quotas[name].Adaptive == nil || cfg.Quotas[name].Key != "" {
			continue // a keyed quota's rates are its key values' (LearnedKeyRates)
		}
		lr, ok, err := readLearned(ctx, rdb, adaptKey(name))
		if err != nil {
			return cfg, nil, fmt.Errorf("jobs: reading the learned rate of quota %q: %w", name, err)
		}
		if ok {
			rates[name] = lr
		}
	}
	pinned := func(quota string) bool { return pinnedBy(rl, quota, now) }
	cfg.Quotas = maps.Clone(cfg.Quotas)
	return mergeLearned(cfg, rates, pinned), rates, nil
}

// pinnedBy reports whether a runtime limit of rl in force at now sets
// quota's own limit: its learned rate then waits.
func pinnedBy(rl []RuntimeLimit, quota string, now time.Time) bool {
	return slices.ContainsFunc(rl, func(r RuntimeLimit) bool {
		return r.Gate == (GateName{QuotaGate, quota}) && r.Key == "" && r.InForce(now)
	})
}
