package jobs

import "github.com/prometheus/client_golang/prometheus"

// Metrics are the scheduler's Prometheus metrics, all under sluice_. Labels
// are bounded: gate ("drain:<queue>", "quota:<name>"), queue and task type
// come from the config, never from task payloads.
type Metrics struct {
	decisions     *prometheus.CounterVec // gate, result
	bookings      *prometheus.CounterVec // queue
	evaluations   *prometheus.CounterVec // gate
	woken         prometheus.Counter
	throttled     *prometheus.CounterVec   // queue, how
	waited        *prometheus.CounterVec   // queue
	remaining     *prometheus.GaugeVec     // gate
	scriptSeconds *prometheus.HistogramVec // gate
	redisErrors   *prometheus.CounterVec   // gate
	fallbacks     *prometheus.CounterVec   // gate, policy
	upstreamBusy  *prometheus.CounterVec   // quota
	completed     *prometheus.CounterVec   // queue, type, result
	slotsLost     *prometheus.CounterVec   // slot, result
	keyFallbacks  *prometheus.CounterVec   // gate
	keyWaits      *prometheus.CounterVec   // gate
	runtimeLimits *prometheus.GaugeVec     // gate
	turnWait      *prometheus.HistogramVec // queue
	admitted      *prometheus.CounterVec   // gate
	adaptiveRate  *prometheus.GaugeVec     // quota
}

// NewMetrics registers the metrics on reg.
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		decisions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "sluice_gate_decisions_total",
			Help: "Gate decisions by result: now (passed at once), lent (passed at once on a turn leased ahead, with no call to Redis), reserved (given a later turn), deferred (no turn within worker.reserve_max), held (a turn booked earlier), parked (gate fair:<queue>: its key held its share, so the task waits in its key's line).",
		}, []string{"gate", "result"}),
		bookings: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "sluice_bookings_total",
			Help: "Limiter calls that booked a task's turn on all its rate gates at once (one round trip per Redis Cluster slot).",
		}, []string{"queue"}),
		evaluations: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "sluice_gate_evaluations_total",
			Help: "Limiter calls (script runs) a gate took part in: bookings, leases of turns lent ahead, and turns given back.",
		}, []string{"gate"}),
		woken: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "sluice_woken_tasks_total",
			Help: "Tasks that waited in Redis, moved back to pending on time by this worker (see the wake set).",
		}),
		throttled: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "sluice_throttled_tasks_total",
			Help: "Tasks that had to wait for their turn, by how: held (in the worker), requeued (scheduled in Redis for their turn) or parked (moved from their queue into a backlog line without a worker taking them).",
		}, []string{"queue", "how"}),
		waited: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "sluice_throttled_seconds_total",
			Help: "Seconds tasks spent waiting in the worker for their turn.",
		}, []string{"queue"}),
		remaining: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "sluice_gate_remaining",
			Help: "Events the gate could still admit at its last decision (the bucket level, as room left).",
		}, []string{"gate"}),
		scriptSeconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "sluice_script_duration_seconds",
			Help:    "Latency of the gates' limiter script calls.",
			Buckets: prometheus.ExponentialBuckets(0.0001, 2, 14),
		}, []string{"gate"}),
		redisErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "sluice_redis_errors_total",
			Help: "Limiter calls that failed because Redis could not be used.",
		}, []string{"gate"}),
		fallbacks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "sluice_policy_fallbacks_total",
			Help: "Times a gate applied its on_redis_error policy (deny, allow or local; a concurrency limit's concurrency_on_redis_error: wait or allow).",
		}, []string{"gate", "policy"}),
		upstreamBusy: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "sluice_upstream_busy_total",
			Help: "Answers 429/503 from a third-party API that blocked its quota (a keyed quota: the task's key value) fleet-wide.",
		}, []string{"quota"}),
		completed: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "sluice_tasks_processed_total",
			Help: "Tasks whose handler ran, by result: ok, error, or upstream_busy (it returned a *jobs.UpstreamBusyError, an API's 429/503: the task waits for the upstream and runs again; not a failure).",
		}, []string{"queue", "type", "result"}),
		slotsLost: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "sluice_slots_lost_total",
			Help: "Concurrency slots a task lost while it ran (its lease ended, or would have before a renew reached Redis), by slot and result: stopped (its handler's context ended; the task runs again) or retaken (a free slot was taken again).",
		}, []string{"slot", "result"}),
		keyFallbacks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "sluice_key_fallbacks_total",
			Help: "Tasks whose key expression failed (a missing field, a wrong type, a payload that is not JSON), so that they took the limit's default key, by gate (drain:<queue>, quota:<name>, fair:<queue>, concurrency:type:<name>).",
		}, []string{"gate"}),
		keyWaits: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "sluice_key_waits_total",
			Help: "Tasks whose key expression failed on a limit with on_key_error: wait, so that they went back to Redis to wait (not failed), by gate (drain:<queue>, quota:<name>).",
		}, []string{"gate"}),
		runtimeLimits: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "sluice_runtime_limits",
			Help: "Overrides set live (enqueue limits set or import, the admin API) in force in this worker, by gate (drain:<queue>, quota:<name>): the gate's own and its key values'.",
		}, []string{"gate"}),
		turnWait: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "sluice_turn_wait_seconds",
			Help:    "Seconds a task is told to wait for its turn on its rate gates, by queue: from its booking to its turn (0: admitted at once), or to its ticket in a backlog line; observed once per turn booked or lent and per ticket, not when the task comes back for a turn it holds (a task back for its ticket books then, and is observed again).",
			Buckets: []float64{0, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 900, 3600},
		}, []string{"queue"}),
		admitted: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "sluice_gate_admitted_tasks_total",
			Help: "Tasks whose handler started after they passed the gate, by gate (drain:<queue>, quota:<name>, fair:<queue>).",
		}, []string{"gate"}),
		adaptiveRate: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "sluice_adaptive_rate",
			Help: "The rate an adaptive quota learned from its upstream's answers, fleet-wide, in events per the quota's period, by quota (its limit in force is this rounded, or an override set live).",
		}, []string{"quota"}),
	}
	reg.MustRegister(m.adaptiveRate, m.turnWait, m.admitted, m.runtimeLimits, m.keyWaits, m.keyFallbacks, m.decisions, m.bookings, m.evaluations, m.woken, m.throttled, m.waited, m.remaining,
		m.scriptSeconds, m.redisErrors, m.fallbacks, m.upstreamBusy, m.completed, m.slotsLost)
	return m
}

// showGates makes the counters of gs's gates exist at 0 before their first
// event, so that a dashboard panel or an alert over them (rate of 429s, of
// failure policies used) reads 0, not "no data", until something happens.
//
// Counters that first appear already above 0 hide their first increase
// from rate(): a drain's whole backlog is booked (reserved) in its first
// second, before a series for it would have existed.
func (m *Metrics) showGates(gs *gateSet) {
	for queue, g := range gs.drains {
		m.showGate(g)
		m.turnWait.WithLabelValues(queue)
	}
	for name, g := range gs.quotas {
		m.showGate(g)
		m.upstreamBusy.WithLabelValues(name)
	}
	for queue, f := range gs.fair {
		m.admitted.WithLabelValues(f.name)
		m.decisions.WithLabelValues(f.name, "parked")
		m.turnWait.WithLabelValues(queue)
	}
}

func (m *Metrics) showGate(g *gate) {
	m.admitted.WithLabelValues(g.name)
	m.decisions.WithLabelValues(g.name, "reserved")
	m.decisions.WithLabelValues(g.name, "deferred")
	m.redisErrors.WithLabelValues(g.name)
	if g.limit.OnRedisError != "" {
		m.fallbacks.WithLabelValues(g.name, g.limit.OnRedisError)
	}
}
