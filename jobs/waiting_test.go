package jobs_test

import (
	"errors"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/sluicehq/sluice/internal/redistest"
	"github.com/sluicehq/sluice/internal/testkit"
	"github.com/sluicehq/sluice/jobs"
)

// slowDrain is a queue drained at 2/s, so that all but the first task of a
// few wait in Redis for their turn (worker.hold_max is 1s).
func slowDrain(queue string) jobs.Config {
	return jobs.Config{
		Worker: jobs.WorkerConfig{Concurrency: 10},
		Queues: map[string]jobs.QueueConfig{queue: {Drain: &jobs.LimitConfig{Limit: 2, Period: time.Second, Burst: 1}}},
	}
}

// TestWaitKeepsIDAndUniqueLock (9.4): while a task waits for its turn, its
// id and its Unique lock stay taken: a second task with the same id, or the
// same type and payload under Unique, is refused; each runs once. A task
// with a retry left waits in Redis (asynq's retry path); one with none left
// waits in the worker (on the retry path asynq would archive it).
func TestWaitKeepsIDAndUniqueLock(t *testing.T) {
	for _, c := range []struct {
		desc     string
		maxRetry int
	}{{"retries left", 25}, {"MaxRetry 0", 0}} {
		t.Run(c.desc, func(t *testing.T) {
			queue := redistest.Queue(t, "q")
			rec := &recorder{}
			fleet(t, slowDrain(queue), 1, rec)
			client := asynq.NewClient(asynq.RedisClientOpt{Addr: redistest.Addr(t)})
			defer client.Close()
			opts := []asynq.Option{asynq.Queue(queue), asynq.MaxRetry(c.maxRetry)}
			// Four tasks ahead of them: at 2/s the two below wait about 2s.
			for _, p := range []string{"a", "b", "c", "d"} {
				if _, err := client.Enqueue(asynq.NewTask("test:record", []byte(p)), opts...); err != nil {
					t.Fatal(err)
				}
			}
			if _, err := client.Enqueue(asynq.NewTask("test:record", []byte("job-1")), append(opts, asynq.TaskID("job-1"))...); err != nil {
				t.Fatal(err)
			}
			if _, err := client.Enqueue(asynq.NewTask("test:record", []byte("unique")), append(opts, asynq.Unique(time.Hour))...); err != nil {
				t.Fatal(err)
			}
			// Once both wait (none pending, not run yet)...
			testkit.WaitFor(t, 5*time.Second, "the tasks to wait", func() bool {
				return redistest.QueueInfo(t, queue).Pending == 0
			})
			if ran := len(rec.Matching(func(k string) bool { return k == "job-1" || k == "unique" })); ran > 0 {
				t.Fatalf("%d of the two tasks ran before the test could check them; the drain is too fast", ran)
			}
			_, err := client.Enqueue(asynq.NewTask("test:record", []byte("job-1 again")), append(opts, asynq.TaskID("job-1"))...)
			if !errors.Is(err, asynq.ErrTaskIDConflict) {
				t.Errorf("enqueueing id job-1 while job-1 waits: %v, want ErrTaskIDConflict", err)
			}
			_, err = client.Enqueue(asynq.NewTask("test:record", []byte("unique")), append(opts, asynq.Unique(time.Hour))...)
			if !errors.Is(err, asynq.ErrDuplicateTask) {
				t.Errorf("enqueueing a Unique duplicate while the first waits: %v, want ErrDuplicateTask", err)
			}
			testkit.WaitFor(t, 10*time.Second, "the tasks to run", func() bool { return rec.Distinct() >= 6 })
			time.Sleep(600 * time.Millisecond)
			for _, p := range []string{"job-1", "unique"} {
				if n := len(rec.Matching(func(k string) bool { return k == p })); n != 1 {
					t.Errorf("task %q ran %d times, want once", p, n)
				}
			}
		})
	}
}

// TestCopyIDTakenByAnother (9.3): a task with no retry left that cannot wait
// in the worker (its deadline is too near) waits in Redis as a copy named
// <id>~<hop>. A producer's task that already has that id is not taken for
// the copy: the waiting task still runs, and so does the producer's.
func TestCopyIDTakenByAnother(t *testing.T) {
	queue := redistest.Queue(t, "q")
	rec := &recorder{}
	_, reg := fleet(t, slowDrain(queue), 1, rec)
	client := asynq.NewClient(asynq.RedisClientOpt{Addr: redistest.Addr(t)})
	defer client.Close()
	opts := []asynq.Option{asynq.Queue(queue), asynq.MaxRetry(0)}
	if _, err := client.Enqueue(asynq.NewTask("test:record", []byte("squatter")), append(opts, asynq.TaskID("victim~1"), asynq.ProcessIn(3*time.Second))...); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{"a", "b", "c"} {
		if _, err := client.Enqueue(asynq.NewTask("test:record", []byte(p)), opts...); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := client.Enqueue(asynq.NewTask("test:record", []byte("victim")), append(opts, asynq.TaskID("victim"), asynq.Timeout(2*time.Second))...); err != nil {
		t.Fatal(err)
	}
	testkit.WaitFor(t, 15*time.Second, "victim and the squatter to run", func() bool {
		return len(rec.Matching(func(k string) bool { return k == "victim" || k == "squatter" })) >= 2
	})
	if info := redistest.QueueInfo(t, queue); info.Archived != 0 {
		t.Errorf("%d tasks archived, want none", info.Archived)
	}
	if copies := counterSum(t, reg, "sluice_throttled_tasks_total", "requeued"); copies < 1 {
		t.Errorf("no task went back to Redis: the copy's id was never in question")
	}
}
