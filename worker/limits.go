package worker

import (
	"context"
	"embed"
	"encoding/json"
	"fmt"
	"html/template"
	"io/fs"
	"log/slog"
	"maps"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hibiken/asynq"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/jobs"
)

// The limits page, at /ui/limits beside asynqmon: every gate with its
// spec, its level, the tasks waiting for it, what this worker admitted and
// throttled through it per second, and the busiest keys of keyed gates.
// The page is a server-rendered table that reloads itself every 2 s
// without JavaScript; limits.js (embedded, no build step) instead fetches
// /ui/limits.json every refreshEvery and redraws the table and a chart per
// gate in place. Nothing is read until someone looks: each request reads
// from Redis what `enqueue status` reads (the limits, the levels, the
// queues' counts, the busiest keys) and this worker's own counters (the
// registry /metrics serves).

//go:embed limits
var limitsFiles embed.FS

var limitsTemplate = template.Must(template.New("limits.html").Funcs(template.FuncMap{
	"level": func(level *int, capacity int) string {
		if level == nil {
			return "-"
		}
		return fmt.Sprintf("%d of %d", *level, capacity)
	},
	"count": func(n *int) string {
		if n == nil {
			return "-"
		}
		return fmt.Sprint(*n)
	},
	"rate": func(r *float64) string {
		if r == nil {
			return "-"
		}
		return fmt.Sprintf("%.1f", *r)
	},
	"seconds": func(s *float64) string {
		if s == nil {
			return "-"
		}
		return time.Duration(*s * float64(time.Second)).Round(time.Second).String()
	},
}).ParseFS(limitsFiles, "limits/limits.html"))

const (
	// limitsHistory is how far back the charts reach (from when the page
	// was first looked at: nothing is sampled while nobody looks).
	limitsHistory = 10 * time.Minute
	// rateWindow is the span over which admitted and throttled per second
	// are averaged.
	rateWindow = 5 * time.Second
	// minSampleGap: requests closer than this to the last sample (several
	// viewers at once) share it.
	minSampleGap = time.Second
	// pageKeys is how many of a keyed gate's busiest keys the page shows.
	pageKeys = 5
	// pageClassified bounds how many tasks of a queue's retry and
	// scheduled sets a request reads to count those waiting for a turn.
	pageClassified = 2000
	// pageTimeout bounds one request's reads of Redis.
	pageTimeout = 3 * time.Second
)

// limitsPage serves the limits page and its JSON.
type limitsPage struct {
	rdb       redis.UniversalClient
	inspector *asynq.Inspector
	metrics   prometheus.Gatherer
	log       *slog.Logger
	// file is the config file's jobs section in force (the file's limits,
	// before any set live): set by the worker at start and on each reload.
	file atomic.Pointer[jobs.Config]

	mu      sync.Mutex
	samples []gateSample // oldest first, at least minSampleGap apart
}

// gateSample is this worker's counters at one instant, by gate.
type gateSample struct {
	at                  time.Time
	admitted, throttled map[string]float64
}

// limitsView is what the page shows; its JSON is /ui/limits.json.
type limitsView struct {
	Time      time.Time `json:"time"`
	RefreshMS int       `json:"refresh_ms"`
	// RateWindowS is the span the rates are over (at least rateWindow; 0
	// until two samples are that far apart).
	RateWindowS  float64    `json:"rate_window_seconds"`
	Gates        []gateView `json:"gates"`
	Error        string     `json:"error,omitempty"`
	HistoryStart time.Time  `json:"history_start"`
}

// gateView is one gate's row.
type gateView struct {
	Gate     string `json:"gate"` // as in the metrics' gate label
	Kind     string `json:"kind"` // drain, quota, fair, concurrency
	File     string `json:"file"` // its spec in the config file
	InForce  string `json:"in_force"`
	Override string `json:"override,omitempty"` // who set the limit in force live, and why
	// Level is how many events it could admit now, of Capacity; null for
	// a keyed gate (see Keys) and for gates that have none.
	Level    *int `json:"level"`
	Capacity int  `json:"capacity,omitempty"`
	// Pending and Waiting are its queue's (drains and fair queues), as
	// enqueue status counts them; null for a quota, whose tasks may be in
	// any queue.
	Pending *int `json:"pending"`
	Waiting *int `json:"waiting"`
	// WaitingAtLeast: the retry or scheduled set held more than
	// pageClassified tasks, and only that many were looked at.
	WaitingAtLeast bool `json:"waiting_at_least,omitempty"`
	// DonePerSecond: the fleet completed its queue's tasks at this rate
	// over the last minute; ThroughSeconds: its backlog (pending, waiting
	// and active) is through in this long at that rate (throughOf).
	DonePerSecond  *float64 `json:"done_per_second"`
	ThroughSeconds *float64 `json:"through_seconds"`
	// ThroughAtLeast: ThroughSeconds is at the drain's rate, before the
	// fleet has one of its own: the backlog takes at least that long (a
	// quota may hold it back more).
	ThroughAtLeast bool `json:"through_at_least,omitempty"`
	// AdmittedPerSecond and ThrottledPerSecond are this worker's over the
	// last rateWindow (null until two samples are that far apart).
	AdmittedPerSecond  *float64   `json:"admitted_per_second"`
	ThrottledPerSecond *float64   `json:"throttled_per_second"`
	History            []ratePair `json:"history"`
	Keys               []keyView  `json:"keys,omitempty"`
}

// ratePair is this worker's admitted and throttled per second between two
// samples, at the later one's time (Unix ms).
type ratePair struct {
	At        int64   `json:"t"`
	Admitted  float64 `json:"admitted"`
	Throttled float64 `json:"throttled"`
}

// keyView is one of a keyed gate's busiest keys (enqueue status --keys).
type keyView struct {
	Key       string `json:"key"`
	Waiting   *int   `json:"waiting"`
	Throttled int    `json:"throttled_last_minute"`
	CanAdmit  bool   `json:"can_admit_now"`
	Remaining int    `json:"remaining"`
}

// refreshEvery is how often the page redraws itself.
const refreshEvery = 1500 * time.Millisecond

func newLimitsPage(rdb redis.UniversalClient, redisOpt asynq.RedisConnOpt, metrics prometheus.Gatherer, file jobs.Config, log *slog.Logger) *limitsPage {
	p := &limitsPage{rdb: rdb, inspector: asynq.NewInspector(redisOpt), metrics: metrics, log: log}
	p.file.Store(&file)
	return p
}

// routes adds the page's paths to mux.
func (p *limitsPage) routes(mux *http.ServeMux) {
	static, _ := fs.Sub(limitsFiles, "limits")
	mux.Handle("GET /ui/limits/static/", http.StripPrefix("/ui/limits/static/", http.FileServerFS(static)))
	mux.HandleFunc("GET /ui/limits", p.serveHTML)
	mux.HandleFunc("GET /ui/limits.json", p.serveJSON)
}

func (p *limitsPage) close() error { return p.inspector.Close() }

// pagePolicy lets the page load its own files only: key values shown on it
// come from payloads, and no markup in them may run.
const pagePolicy = "default-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'self'"

func (p *limitsPage) serveHTML(w http.ResponseWriter, r *http.Request) {
	v := p.view(r.Context())
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.Header().Set("Content-Security-Policy", pagePolicy)
	w.Header().Set("Cache-Control", "no-store")
	if err := limitsTemplate.Execute(w, v); err != nil {
		p.log.Warn("limits page", "err", err)
	}
}

func (p *limitsPage) serveJSON(w http.ResponseWriter, r *http.Request) {
	v := p.view(r.Context())
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	json.NewEncoder(w).Encode(v)
}

// view reads the gates' figures now. A failure to read Redis is shown on
// the page, with this worker's own figures.
func (p *limitsPage) view(ctx context.Context) limitsView {
	ctx, cancel := context.WithTimeout(ctx, pageTimeout)
	defer cancel()
	now := time.Now()
	v := limitsView{Time: now.UTC().Truncate(time.Millisecond), RefreshMS: int(refreshEvery / time.Millisecond)}
	file := *p.file.Load()
	history := p.sample(now)
	if len(history) > 0 {
		v.HistoryStart = history[0].at.UTC()
	}
	base := rateBase(history)
	if base >= 0 {
		v.RateWindowS = history[len(history)-1].at.Sub(history[base].at).Seconds()
	}
	if err := p.readGates(ctx, &v, file); err != nil {
		v.Error = "reading Redis: " + err.Error()
	}
	for i := range v.Gates {
		g := &v.Gates[i]
		g.AdmittedPerSecond, g.ThrottledPerSecond = ratesOf(history, base, g.Gate)
		g.History = historyOf(history, g.Gate)
	}
	return v
}

// readGates fills v.Gates from Redis: the limits in force, the levels, the
// queues' counts and rates, and the busiest keys.
func (p *limitsPage) readGates(ctx context.Context, v *limitsView, file jobs.Config) error {
	limits, err := jobs.ListLimits(ctx, p.rdb, file, false)
	if err != nil {
		return err
	}
	cfg, err := jobs.InForce(ctx, p.rdb, file, time.Now())
	if err != nil {
		return err
	}
	levels, err := jobs.Levels(ctx, p.rdb, cfg)
	if err != nil {
		return err
	}
	known, err := p.inspector.Queues()
	if err != nil {
		return err
	}
	for _, l := range limits {
		g := gateView{Gate: l.Gate.String(), Kind: "drain", File: l.File.String(), InForce: l.InForce.String()}
		if l.Gate.Kind == jobs.QuotaGate {
			g.Kind = "quota"
		}
		if o := l.Override; o != nil {
			g.Override = fmt.Sprintf("set live by %s: %s", o.By, o.Reason)
			if !o.Until.IsZero() {
				g.Override += " (until " + o.Until.UTC().Format(time.DateTime) + " UTC)"
			}
		}
		if l.KeyOverrides > 0 {
			g.Override = strings.TrimPrefix(g.Override+fmt.Sprintf("; %d key values set live", l.KeyOverrides), "; ")
		}
		if level, ok := levels[g.Gate]; ok {
			g.Level, g.Capacity = &level, capacityOf(l.InForce)
		}
		if l.Gate.Kind == jobs.DrainGate {
			if err := p.readQueue(ctx, &g, l.Gate.Name, known, &l.InForce); err != nil {
				return err
			}
		}
		if l.InForce.Key != "" {
			if g.Keys, err = p.busiest(ctx, cfg, g.Gate); err != nil {
				return err
			}
		}
		v.Gates = append(v.Gates, g)
	}
	for _, q := range sortedNames(cfg.Queues) {
		qc := cfg.Queues[q]
		if qc.Fairness != nil {
			g := gateView{Gate: "fair:" + q, Kind: "fair", File: "a fair share of the drain by " + qc.Fairness.Key}
			g.InForce = g.File
			if err := p.readQueue(ctx, &g, q, known, nil); err != nil {
				return err
			}
			if g.Keys, err = p.busiest(ctx, cfg, g.Gate); err != nil {
				return err
			}
			v.Gates = append(v.Gates, g)
		}
		if qc.Concurrency > 0 {
			g := gateView{Gate: "concurrency:queue:" + q, Kind: "concurrency", File: fmt.Sprintf("%d at once", qc.Concurrency)}
			g.InForce = g.File
			v.Gates = append(v.Gates, g)
		}
	}
	for _, typ := range sortedNames(cfg.Tasks) {
		tc := cfg.Tasks[typ]
		if tc.Concurrency == 0 {
			continue
		}
		g := gateView{Gate: "concurrency:type:" + typ, Kind: "concurrency", File: fmt.Sprintf("%d at once", tc.Concurrency)}
		if tc.ConcurrencyKey != "" {
			g.File += " per " + tc.ConcurrencyKey
			if g.Keys, err = p.busiest(ctx, cfg, g.Gate); err != nil {
				return err
			}
		}
		g.InForce = g.File
		v.Gates = append(v.Gates, g)
	}
	return nil
}

// readQueue fills g with queue's counts and rate, as enqueue status reads
// them, and when its backlog is through (throughOf; drain: the queue's
// drain in force, if any).
func (p *limitsPage) readQueue(ctx context.Context, g *gateView, queue string, known []string, drain *jobs.LimitSpec) error {
	pending, waiting, active := 0, 0, 0
	if slices.Contains(known, queue) {
		info, err := p.inspector.GetQueueInfo(queue)
		if err != nil {
			return err
		}
		pending, active = info.Pending, info.Active
		for _, list := range []func(string, ...asynq.ListOption) ([]*asynq.TaskInfo, error){p.inspector.ListRetryTasks, p.inspector.ListScheduledTasks} {
			infos, err := list(queue, asynq.PageSize(pageClassified))
			if err != nil {
				return err
			}
			for _, t := range infos {
				if jobs.WaitingTask(t) {
					waiting++
				}
			}
			g.WaitingAtLeast = g.WaitingAtLeast || len(infos) == pageClassified
		}
	}
	rate, err := jobs.RecentRate(ctx, p.rdb, queue)
	if err != nil {
		return err
	}
	g.Pending, g.Waiting, g.DonePerSecond = &pending, &waiting, &rate
	g.ThroughSeconds, g.ThroughAtLeast = throughOf(pending+waiting+active, rate, drain)
	return nil
}

// throughOf is how long a backlog of tasks takes at done, the rate the
// fleet did the queue's tasks over the last minute, or, before it has one
// (a drain's first seconds, when an operator looks), at least how long at
// the rate of the queue's drain (atLeast); nil if neither is known (a
// keyed drain's rate is each key's).
func throughOf(backlog int, done float64, drain *jobs.LimitSpec) (seconds *float64, atLeast bool) {
	rate := done
	if rate <= 0 && backlog > 0 && drain != nil && drain.Key == "" {
		if period, err := time.ParseDuration(drain.Period); err == nil && period > 0 {
			rate, atLeast = float64(drain.Limit)/period.Seconds(), true
		}
	}
	if backlog == 0 {
		return new(float64), false // through
	}
	if rate <= 0 {
		return nil, false
	}
	through := float64(backlog) / rate
	return &through, atLeast
}

// busiest lists gate's busiest keys.
func (p *limitsPage) busiest(ctx context.Context, cfg jobs.Config, gate string) ([]keyView, error) {
	loads, err := jobs.KeyLoads(ctx, p.rdb, cfg, gate, pageKeys)
	if err != nil {
		return nil, err
	}
	keys := make([]keyView, 0, len(loads))
	for _, l := range loads {
		k := keyView{Key: l.Key, Throttled: l.Throttled, CanAdmit: l.CanAdmit, Remaining: l.Remaining}
		if l.Waiting >= 0 {
			k.Waiting = &l.Waiting
		}
		keys = append(keys, k)
	}
	return keys, nil
}

// capacityOf is the most a limit can admit at once: its burst for the
// buckets, its limit for the windows.
func capacityOf(l jobs.LimitSpec) int {
	if l.Burst > 0 {
		return l.Burst
	}
	return l.Limit
}

// sample takes this worker's counters now (unless the last sample is
// newer than minSampleGap), drops those older than limitsHistory, and
// returns the samples.
func (p *limitsPage) sample(now time.Time) []gateSample {
	p.mu.Lock()
	defer p.mu.Unlock()
	if n := len(p.samples); n == 0 || now.Sub(p.samples[n-1].at) >= minSampleGap {
		s, err := p.gather(now)
		if err != nil {
			p.log.Warn("limits page: reading this worker's metrics", "err", err)
		} else {
			p.samples = append(p.samples, s)
		}
	}
	drop := 0
	for drop < len(p.samples) && now.Sub(p.samples[drop].at) > limitsHistory {
		drop++
	}
	p.samples = slices.Delete(p.samples, 0, drop)
	return slices.Clone(p.samples)
}

// throttledResults are the gate decisions that made a task wait.
var throttledResults = []string{"reserved", "deferred", "parked"}

// gather reads this worker's admitted and throttled counters by gate from
// its registry: the figures /metrics serves.
func (p *limitsPage) gather(now time.Time) (gateSample, error) {
	s := gateSample{at: now, admitted: map[string]float64{}, throttled: map[string]float64{}}
	families, err := p.metrics.Gather()
	if err != nil {
		return s, err
	}
	for _, f := range families {
		switch f.GetName() {
		case "sluice_gate_admitted_tasks_total":
			for _, m := range f.GetMetric() {
				s.admitted[labelOf(m.GetLabel(), "gate")] += m.GetCounter().GetValue()
			}
		case "sluice_gate_decisions_total":
			for _, m := range f.GetMetric() {
				if slices.Contains(throttledResults, labelOf(m.GetLabel(), "result")) {
					s.throttled[labelOf(m.GetLabel(), "gate")] += m.GetCounter().GetValue()
				}
			}
		}
	}
	return s, nil
}

func labelOf(labels []*dto.LabelPair, name string) string {
	for _, l := range labels {
		if l.GetName() == name {
			return l.GetValue()
		}
	}
	return ""
}

// rateBase is the index of the sample the rates are taken from: the
// newest one at least rateWindow older than the newest; -1 if none is.
func rateBase(samples []gateSample) int {
	for i := len(samples) - 2; i >= 0; i-- {
		if samples[len(samples)-1].at.Sub(samples[i].at) >= rateWindow {
			return i
		}
	}
	return -1
}

// ratesOf is gate's admitted and throttled per second from the sample at
// base (rateBase) to the newest; none if base is -1.
func ratesOf(samples []gateSample, base int, gate string) (admitted, throttled *float64) {
	if base < 0 {
		return nil, nil
	}
	from, last := samples[base], samples[len(samples)-1]
	d := last.at.Sub(from.at).Seconds()
	a := (last.admitted[gate] - from.admitted[gate]) / d
	t := (last.throttled[gate] - from.throttled[gate]) / d
	return &a, &t
}

// historyOf is gate's rates between consecutive samples.
func historyOf(samples []gateSample, gate string) []ratePair {
	h := []ratePair{}
	for i := 1; i < len(samples); i++ {
		d := samples[i].at.Sub(samples[i-1].at).Seconds()
		h = append(h, ratePair{At: samples[i].at.UnixMilli(),
			Admitted:  (samples[i].admitted[gate] - samples[i-1].admitted[gate]) / d,
			Throttled: (samples[i].throttled[gate] - samples[i-1].throttled[gate]) / d})
	}
	return h
}

func sortedNames[V any](m map[string]V) []string { return slices.Sorted(maps.Keys(m)) }
