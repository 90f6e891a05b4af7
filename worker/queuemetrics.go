package worker

import (
	"context"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/jobs"
)

// queueSizes is a Prometheus collector of the configured queues' task
// counts, read from Redis at each scrape (one round trip per queue): the
// backlog the dashboard divides by the rate to tell when it will be
// through. Every worker reports the same fleet-wide counts: take the max
// over instances.
type queueSizes struct {
	rdb    redis.UniversalClient
	queues atomic.Pointer[[]string] // the config's, updated on reload
	log    *slog.Logger
	desc   *prometheus.Desc
}

// queueSizesTimeout bounds a scrape's reads of Redis.
const queueSizesTimeout = 2 * time.Second

func newQueueSizes(rdb redis.UniversalClient, cfg jobs.Config, log *slog.Logger) *queueSizes {
	c := &queueSizes{rdb: rdb, log: log, desc: prometheus.NewDesc("sluice_queue_tasks",
		"Tasks of a configured queue in Redis by asynq state (pending, active, scheduled, retry; tasks waiting for their turn are among scheduled and retry), read at each scrape: the same for every worker of a fleet.",
		[]string{"queue", "state"}, nil)}
	c.setQueues(cfg)
	return c
}

func (c *queueSizes) setQueues(cfg jobs.Config) {
	queues := sortedNames(cfg.Queues)
	c.queues.Store(&queues)
}

func (c *queueSizes) Describe(ch chan<- *prometheus.Desc) { ch <- c.desc }

func (c *queueSizes) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), queueSizesTimeout)
	defer cancel()
	for _, q := range *c.queues.Load() {
		sizes, err := jobs.QueueSizes(ctx, c.rdb, q)
		if err != nil {
			// A scrape without them shows as a gap, and the log says why.
			c.log.Warn("cannot read the queues' sizes for the metrics", "err", err)
			return
		}
		for _, state := range jobs.QueueStates {
			ch <- prometheus.MustNewConstMetric(c.desc, prometheus.GaugeValue, float64(sizes[state]), q, state)
		}
	}
}
