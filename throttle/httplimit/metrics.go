package httplimit

import (
	"fmt"

	"github.com/prometheus/client_golang/prometheus"
)

// metrics are the Limiter's Prometheus metrics (see the package doc).
// Label values come from the Config, never from requests.
type metrics struct {
	decisions   *prometheus.CounterVec // limit, result
	bans        *prometheus.CounterVec // key
	fallbacks   *prometheus.CounterVec // limit, policy
	redisErrors *prometheus.CounterVec // limit
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		decisions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "sluice_http_decisions_total",
			Help: "Decisions of each limit on requests, by result: allowed, refused; limit \"ban\": refused by a ban.",
		}, []string{"limit", "result"}),
		bans: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "sluice_http_bans_total",
			Help: "Bans given, by what they are on: ip (a client address) or client (an API key).",
		}, []string{"key"}),
		fallbacks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "sluice_http_policy_fallbacks_total",
			Help: "Requests a limit decided by its on_redis_error policy (deny, allow or local) because Redis failed.",
		}, []string{"limit", "policy"}),
		redisErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "sluice_http_redis_errors_total",
			Help: "Redis calls that failed, by limit (\"ban\" for the bans).",
		}, []string{"limit"}),
	}
	for _, c := range []prometheus.Collector{m.decisions, m.bans, m.fallbacks, m.redisErrors} {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("httplimit: registering metrics: %w", err)
		}
	}
	return m, nil
}
