package jobs_test

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/sluicehq/sluice/internal/redistest"
	"github.com/sluicehq/sluice/internal/testkit"
	"github.com/sluicehq/sluice/jobs"
)

// TestLongTaskIDs (19.4): tasks from a plain asynq.Client with ids of
// 1,100 bytes and 64 KiB, MaxRetry 0, through a drain of 4/s (burst 1) and
// a quota, in a queue first come first served and in a fair one: every one
// runs once and none is archived, also those that wait in Redis as copies
// (turns more than hold_max away) or in their key's line. (The booking
// refused ids over 1 KiB as a bad cost: they were archived with 0 runs.)
func TestLongTaskIDs(t *testing.T) {
	t.Parallel()
	queue, fair, quota := redistest.Queue(t, "q"), redistest.Queue(t, "fair"), redistest.Queue(t, "api")
	drain := &jobs.LimitConfig{Limit: 4, Period: time.Second, Burst: 1}
	cfg := jobs.Config{
		Worker: jobs.WorkerConfig{Concurrency: 10},
		Queues: map[string]jobs.QueueConfig{queue: {Drain: drain}, fair: {Drain: drain, Fairness: &jobs.FairnessConfig{Key: "payload.t"}}},
		Quotas: map[string]jobs.LimitConfig{quota: {Limit: 100, Period: time.Second}},
		Tasks:  map[string]jobs.TaskConfig{"test:record": {Quotas: []string{quota}}},
	}
	rec := &recorder{}
	_, reg := fleet(t, cfg, 1, rec)
	client := asynq.NewClient(asynq.RedisClientOpt{Addr: redistest.Addr(t)})
	defer client.Close()
	const each = 8
	for _, q := range []string{queue, fair} {
		for i := range each {
			size := 1100
			if i == each-1 {
				size = 64 << 10
			}
			id := fmt.Sprint(i, "-") + strings.Repeat("x", size)
			task := asynq.NewTask("test:record", fmt.Appendf(nil, `{"t": "%c", "q": %q, "i": %d}`, 'a'+i%2, q, i))
			if _, err := client.Enqueue(task, asynq.Queue(q), asynq.TaskID(id), asynq.MaxRetry(0)); err != nil {
				t.Fatal(err)
			}
		}
	}
	archived := func() int { return redistest.QueueInfo(t, queue).Archived + redistest.QueueInfo(t, fair).Archived }
	testkit.WaitFor(t, 20*time.Second, "every task to run or be archived", func() bool {
		return len(rec.All())+archived() >= 2*each
	})
	if len(rec.All()) != 2*each || rec.Distinct() != 2*each || archived() != 0 {
		t.Fatalf("%d runs of %d distinct tasks and %d archived, want each of the %d tasks run once and none archived",
			len(rec.All()), rec.Distinct(), archived(), 2*each)
	}
	if requeued := counterSum(t, reg, "sluice_throttled_tasks_total", "requeued"); requeued == 0 {
		t.Error("no task waited in Redis: the copies of long ids went untested")
	}
}
