package jobs_test

import (
	"context"
	"errors"
	"sync/atomic"
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
	t.Parallel()
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
	t.Parallel()
	queue := redistest.Queue(t, "q")
	rec := &recorder{}
	_, reg := fleet(t, slowDrain(queue), 1, rec)
	client := asynq.NewClient(asynq.RedisClientOpt{Addr: redistest.Addr(t)})
	defer client.Close()
	opts := []asynq.Option{asynq.Queue(queue), asynq.MaxRetry(0)}
	if _, err := client.Enqueue(asynq.NewTask("test:record", []byte("squatter")), append(opts, asynq.TaskID("victim~1"), asynq.ProcessIn(3*time.Second))...); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{"a", "b", "c", "d", "e"} {
		if _, err := client.Enqueue(asynq.NewTask("test:record", []byte(p)), opts...); err != nil {
			t.Fatal(err)
		}
	}
	// Booked after them: its turn 2.5s away, beyond what its 2s timeout
	// lets it wait in the worker.
	testkit.WaitFor(t, 5*time.Second, "the others to be booked", func() bool { return redistest.QueueInfo(t, queue).Pending == 0 })
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

// busyOnce answers the first task with an upstream's 429 and a Retry-After
// of ten years, and notes every run.
type busyOnce struct {
	recorder
	busy atomic.Bool
}

func (b *busyOnce) ProcessTask(ctx context.Context, t *asynq.Task) error {
	b.Note(string(t.Payload()))
	if b.busy.CompareAndSwap(false, true) {
		return &jobs.UpstreamBusyError{Status: 429, RetryAfter: 10 * 365 * 24 * time.Hour}
	}
	return nil
}

// TestRetryAfterClamped (9.2): an upstream's Retry-After of ten years blocks
// the quota for its max_block (here 2s), not ten years: the tasks run
// again once it is over, and the quota says so.
func TestRetryAfterClamped(t *testing.T) {
	t.Parallel() // it mostly waits: beside the package's other tests
	queue, quota := redistest.Queue(t, "q"), redistest.Queue(t, "api")
	cfg := jobs.Config{
		Worker: jobs.WorkerConfig{Concurrency: 4},
		Queues: map[string]jobs.QueueConfig{queue: {}},
		Quotas: map[string]jobs.LimitConfig{quota: {Limit: 100, Period: time.Second, MaxBlock: 2 * time.Second}},
		Tasks:  map[string]jobs.TaskConfig{"test:record": {Quotas: []string{quota}}},
	}
	rec := &busyOnce{}
	fleet(t, cfg, 1, rec)
	enqueue(t, queue, 1)
	testkit.WaitFor(t, 5*time.Second, "the first run", func() bool { return len(rec.All()) >= 1 })
	blockedAt := time.Now()
	enqueue(t, queue, 3)
	testkit.WaitFor(t, 10*time.Second, "every task after the block", func() bool { return len(rec.All()) >= 5 })
	runs := rec.All()
	if first := runs[1].Sub(blockedAt); first < 1500*time.Millisecond || first > 4*time.Second {
		t.Errorf("the first run after the 429 came %v after it; want about max_block, 2s", first)
	}
}

// TestPausedQueueResumesAtItsRate (10.1): a drained queue paused part-way
// (as an outage or a deploy would) resumes at its rate: turns booked before
// the pause and come back for long after it are booked again, not run
// together.
func TestPausedQueueResumesAtItsRate(t *testing.T) {
	t.Parallel()
	queue := redistest.Queue(t, "q")
	cfg := jobs.Config{
		Worker: jobs.WorkerConfig{Concurrency: 10},
		Queues: map[string]jobs.QueueConfig{queue: {Drain: &jobs.LimitConfig{Limit: 10, Period: time.Second, Burst: 1}}},
	}
	rec := &recorder{}
	fleet(t, cfg, 2, rec)
	inspector := asynq.NewInspector(asynq.RedisClientOpt{Addr: redistest.Addr(t)})
	defer inspector.Close()
	enqueue(t, queue, 40, asynq.MaxRetry(0))
	testkit.WaitFor(t, 5*time.Second, "the run to get going", func() bool { return len(rec.All()) >= 8 })
	if err := inspector.PauseQueue(queue); err != nil {
		t.Fatal(err)
	}
	time.Sleep(3 * time.Second)
	resumed := time.Now()
	if err := inspector.UnpauseQueue(queue); err != nil {
		t.Fatal(err)
	}
	testkit.WaitFor(t, 15*time.Second, "every task", func() bool { return len(rec.All()) >= 40 })
	after := rec.Matching(func(string) bool { return true })
	var later []time.Time
	for _, at := range after {
		if at.After(resumed) {
			later = append(later, at)
		}
	}
	if most := testkit.MaxInWindow(later, time.Second); most > 11 {
		t.Errorf("%d tasks within one second after the pause, want at most the rate + burst, 11", most)
	}
	if rec.Distinct() != 40 || len(after) != 40 {
		t.Errorf("%d runs of %d tasks, want 40 of 40", len(after), rec.Distinct())
	}
}
