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
// a quota: every one runs once and none is archived, also those that wait
// in Redis as copies (turns more than hold_max away). (The booking refused
// ids over 1 KiB as a bad cost: they were archived with 0 runs.)
func TestLongTaskIDs(t *testing.T) {
	queue, quota := redistest.Queue(t, "q"), redistest.Queue(t, "api")
	cfg := jobs.Config{
		Worker: jobs.WorkerConfig{Concurrency: 10},
		Queues: map[string]jobs.QueueConfig{queue: {Drain: &jobs.LimitConfig{Limit: 4, Period: time.Second, Burst: 1}}},
		Quotas: map[string]jobs.LimitConfig{quota: {Limit: 100, Period: time.Second}},
		Tasks:  map[string]jobs.TaskConfig{"test:record": {Quotas: []string{quota}}},
	}
	rec := &recorder{}
	_, reg := fleet(t, cfg, 1, rec)
	client := asynq.NewClient(asynq.RedisClientOpt{Addr: redistest.Addr(t)})
	defer client.Close()
	const tasks = 8
	for i := range tasks {
		size := 1100
		if i == tasks-1 {
			size = 64 << 10
		}
		id := fmt.Sprint(i, "-") + strings.Repeat("x", size)
		task := asynq.NewTask("test:record", []byte(fmt.Sprint(i)))
		if _, err := client.Enqueue(task, asynq.Queue(queue), asynq.TaskID(id), asynq.MaxRetry(0)); err != nil {
			t.Fatal(err)
		}
	}
	testkit.WaitFor(t, 15*time.Second, "every task to run or be archived", func() bool {
		info := redistest.QueueInfo(t, queue)
		return len(rec.All())+info.Archived >= tasks
	})
	if info := redistest.QueueInfo(t, queue); len(rec.All()) != tasks || rec.Distinct() != tasks || info.Archived != 0 {
		t.Fatalf("%d runs of %d distinct tasks and %d archived, want each of the %d tasks run once and none archived",
			len(rec.All()), rec.Distinct(), info.Archived, tasks)
	}
	if requeued := counterSum(t, reg, "sluice_throttled_tasks_total", "requeued"); requeued == 0 {
		t.Error("no task waited in Redis: the copies of long ids went untested")
	}
}
