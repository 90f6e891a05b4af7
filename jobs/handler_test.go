package jobs_test

import (
	"context"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/sluicehq/sluice/internal/redistest"
	"github.com/sluicehq/sluice/internal/testkit"
	"github.com/sluicehq/sluice/jobs"
)

// misbehaving is a handler that ends the tasks whose ID starts with "bad"
// as how says ("panic" or "goexit"), and notes the others' runs.
type misbehaving struct {
	recorder
	how string
}

func (h *misbehaving) ProcessTask(ctx context.Context, t *asynq.Task) error {
	if id, _ := asynq.GetTaskID(ctx); strings.HasPrefix(id, "bad") {
		switch h.how {
		case "panic":
			panic("boom in " + id)
		case "goexit":
			runtime.Goexit()
		}
	}
	return h.recorder.ProcessTask(ctx, t)
}

// TestHandlerEndsGiveBack (issue 19.1): a handler that panics or calls
// runtime.Goexit gives back its task's run token and concurrency slot: the
// 5 tasks enqueued after the bad ones all run (within 20 s; on main none
// ran), and each bad task (MaxRetry 0) is archived as failed, a panic with
// its message in the task's last error.
func TestHandlerEndsGiveBack(t *testing.T) {
	t.Parallel()
	cases := []struct {
		desc    string
		how     string
		workers int
		cfg     func(queue string) jobs.Config
		bad     int
	}{
		{"a panic, queue concurrency 1, two workers", "panic", 2, func(queue string) jobs.Config {
			return jobs.Config{Queues: map[string]jobs.QueueConfig{queue: {Concurrency: 1}}}
		}, 1},
		{"two panics, worker.concurrency 2", "panic", 1, func(queue string) jobs.Config {
			return jobs.Config{Worker: jobs.WorkerConfig{Concurrency: 2}, Queues: map[string]jobs.QueueConfig{queue: {}}}
		}, 2},
		{"runtime.Goexit, queue concurrency 1, two workers", "goexit", 2, func(queue string) jobs.Config {
			return jobs.Config{Queues: map[string]jobs.QueueConfig{queue: {Concurrency: 1}}}
		}, 1},
	}
	for _, c := range cases {
		t.Run(c.desc, func(t *testing.T) {
			queue := redistest.Queue(t, "q")
			h := &misbehaving{how: c.how}
			fleet(t, c.cfg(queue), c.workers, h)
			// asynq ends a task whose handler never returned (Goexit) at
			// its deadline.
			for i := range c.bad {
				enqueue(t, queue, 1, asynq.TaskID("bad"+string(rune('a'+i))), asynq.MaxRetry(0), asynq.Timeout(2*time.Second))
			}
			testkit.WaitFor(t, 10*time.Second, "the bad tasks to start", func() bool {
				info := redistest.QueueInfo(t, queue)
				return info.Pending == 0 && info.Scheduled == 0 && info.Retry == 0
			})
			enqueue(t, queue, 5)
			testkit.WaitFor(t, 20*time.Second, "the 5 tasks after the bad ones to run", func() bool { return len(h.All()) == 5 })
			testkit.WaitFor(t, 10*time.Second, "the bad tasks to be archived", func() bool {
				return redistest.QueueInfo(t, queue).Archived == c.bad
			})
			inspector := asynq.NewInspector(asynq.RedisClientOpt{Addr: redistest.Addr(t)})
			defer inspector.Close()
			for i := range c.bad {
				id := "bad" + string(rune('a'+i))
				info, err := inspector.GetTaskInfo(queue, id)
				if err != nil {
					t.Fatal(err)
				}
				if c.how == "panic" && !(strings.Contains(info.LastErr, "panic") && strings.Contains(info.LastErr, "boom in "+id)) {
					t.Fatalf("task %s archived with last error %q, want the panic and its message", id, info.LastErr)
				}
			}
		})
	}
}
