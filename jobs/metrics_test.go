package jobs_test

import (
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/sluicehq/sluice/internal/redistest"
	"github.com/sluicehq/sluice/internal/testkit"
	"github.com/sluicehq/sluice/jobs"
)

// TestGateMetrics: 30 tasks through a drain of 20/s (burst 1) and a quota
// that never binds, on one worker: each gate counts 30 admitted tasks,
// every task's turn wait is observed once (the first admitted at once,
// others later, none beyond the 5 s bucket: the drain needs 1.5 s for all), and the
// counters of what has not happened yet (429s, failure policies) exist at 0.
// Every metric's name and help pass Prometheus's lint (promtool's checks).
func TestGateMetrics(t *testing.T) {
	t.Parallel()
	queue, quota := redistest.Queue(t, "q"), redistest.Queue(t, "api")
	cfg := jobs.Config{
		Worker: jobs.WorkerConfig{Concurrency: 10},
		Queues: map[string]jobs.QueueConfig{queue: {Drain: &jobs.LimitConfig{Limit: 20, Period: time.Second, Burst: 1}}},
		Quotas: map[string]jobs.LimitConfig{quota: {Limit: 10000, Period: time.Second}},
		Tasks:  map[string]jobs.TaskConfig{"test:record": {Quotas: []string{quota}}},
	}
	rec := &recorder{}
	_, reg := fleet(t, cfg, 1, rec)
	const tasks = 30
	enqueue(t, queue, tasks)
	testkit.WaitFor(t, 15*time.Second, "all tasks to run", func() bool { return len(rec.All()) >= tasks })
	time.Sleep(200 * time.Millisecond)

	for _, gate := range []string{"drain:" + queue, "quota:" + quota} {
		if got := counterSum(t, reg, "sluice_gate_admitted_tasks_total", gate); got != tasks {
			t.Errorf("sluice_gate_admitted_tasks_total{gate=%q} = %v, want %d", gate, got, tasks)
		}
	}
	count, atOnce, within := turnWaits(t, reg, queue)
	if count != tasks || atOnce < 1 || atOnce == tasks || within != tasks {
		t.Errorf("sluice_turn_wait_seconds{queue=%q}: %d observed, %d at once, %d within 5 s; want %d, at least 1 but not all at once, all within 5 s", queue, count, atOnce, within, tasks)
	}
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	shown := map[string]bool{}
	for _, f := range families {
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				shown[f.GetName()+"/"+l.GetValue()] = true
			}
		}
	}
	problems, err := testutil.GatherAndLint(reg)
	if err != nil || len(problems) > 0 {
		t.Errorf("the metrics' lint: %v %+v", err, problems)
	}
	for _, want := range []string{"sluice_upstream_busy_total/" + quota, "sluice_policy_fallbacks_total/quota:" + quota, "sluice_redis_errors_total/drain:" + queue} {
		if !shown[want] {
			t.Errorf("no %s series before its first event, want one at 0", want)
		}
	}
}

// turnWaits reads queue's sluice_turn_wait_seconds: how many were
// observed, how many were 0 and how many at most 5 s.
func turnWaits(t *testing.T, reg *prometheus.Registry, queue string) (count, atOnce, within int) {
	t.Helper()
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() != "sluice_turn_wait_seconds" {
			continue
		}
		for _, m := range f.GetMetric() {
			if m.GetLabel()[0].GetValue() != queue {
				continue
			}
			h := m.GetHistogram()
			count = int(h.GetSampleCount())
			for _, b := range h.GetBucket() {
				switch b.GetUpperBound() {
				case 0:
					atOnce = int(b.GetCumulativeCount())
				case 5:
					within = int(b.GetCumulativeCount())
				}
			}
		}
	}
	return count, atOnce, within
}
