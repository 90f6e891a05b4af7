package jobs_test

import (
	"testing"
	"time"

	"github.com/sluicehq/sluice/internal/redistest"
	"github.com/sluicehq/sluice/internal/testkit"
	"github.com/sluicehq/sluice/jobs"
)

// TestUpstreamBusyIsNotAnError: a handler that returns an upstream's 429
// (a *jobs.UpstreamBusyError) counts as result="upstream_busy" in
// sluice_tasks_processed_total, not as an error; its run after the block
// (max_block 1s) counts as ok.
func TestUpstreamBusyIsNotAnError(t *testing.T) {
	t.Parallel()
	queue, quota := redistest.Queue(t, "q"), redistest.Queue(t, "api")
	cfg := jobs.Config{
		Queues: map[string]jobs.QueueConfig{queue: {}},
		Quotas: map[string]jobs.LimitConfig{quota: {Limit: 100, Period: time.Second, MaxBlock: time.Second}},
		Tasks:  map[string]jobs.TaskConfig{"test:record": {Quotas: []string{quota}}},
	}
	rec := &busyOnce{}
	_, reg := fleet(t, cfg, 1, rec)
	enqueue(t, queue, 1)
	testkit.WaitFor(t, 10*time.Second, "the run after the block", func() bool { return len(rec.All()) >= 2 })
	testkit.WaitFor(t, 5*time.Second, "the run after the block to be counted", func() bool {
		return counterSum(t, reg, "sluice_tasks_processed_total", "ok") == 1
	})
	busy, failed := counterSum(t, reg, "sluice_tasks_processed_total", "upstream_busy"), counterSum(t, reg, "sluice_tasks_processed_total", "error")
	if busy != 1 || failed != 0 {
		t.Errorf("sluice_tasks_processed_total: upstream_busy %v, error %v; want 1 and 0", busy, failed)
	}
}
