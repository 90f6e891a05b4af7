package jobs_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/internal/redistest"
	"github.com/sluicehq/sluice/internal/testkit"
	"github.com/sluicehq/sluice/jobs"
)

// TestETAStates, with the limits on a server and on a cluster: 16 tasks through a drain of 2/s on one worker that
// holds none (worker.hold_max 1ns) and books at most 5 s ahead: once the
// worker has taken them all, those with a turn within 5 s are booked at
// turns 500 ms apart, the rest ask again (in a second, or at their backlog
// line's tickets) within 10 s (those that ran are gone); a queue no worker serves has its
// tasks pending at positions 1, 2, 3, predicted 500 ms apart from now; an
// id no queue holds is a TaskNotFoundError naming the queues searched, and
// one two queues hold, looked for in every queue, an AmbiguousTaskError
// naming both.
func TestETAStates(t *testing.T) {
	t.Parallel()
	for name, rdb := range map[string]redis.UniversalClient{"redis": redistest.Client(t), "cluster": redistest.Cluster(t)} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			testETAStates(t, rdb)
		})
	}
}

// testETAStates is TestETAStates with the limits on rdb.
func testETAStates(t *testing.T, rdb redis.UniversalClient) {
	queue, idle := redistest.Queue(t, "q"), redistest.Queue(t, "idle")
	const reserveMax = 5 * time.Second
	drain := &jobs.LimitConfig{Limit: 2, Period: time.Second, Burst: 1}
	served := jobs.Config{
		// More slots than tasks: the worker takes every task at once, books
		// it and sends it back (with the limits on the cluster nothing is
		// parked; with 10 slots the tasks went round through them, and on
		// a busy machine most had run before the queue was ever empty).
		// Booking 5 s ahead leaves booked tasks to find after a slow start:
		// a task with a ticket comes back to book only 300 ms before its
		// turn, so once the first bookings have run few tasks are booked
		// (with 2 s, CI's cluster run found 1 booked, 7 asking again).
		Worker: jobs.WorkerConfig{Concurrency: 32, Waiting: 32, HoldMax: time.Nanosecond, ReserveMax: reserveMax},
		Queues: map[string]jobs.QueueConfig{queue: {Drain: drain}},
	}
	startWorker(t, rdb, served, jobs.NewMetrics(prometheus.NewRegistry()), &recorder{})
	client := asynq.NewClient(asynq.RedisClientOpt{Addr: redistest.Addr(t)})
	defer client.Close()
	// Looked for without a queue, a task is looked for in every queue on
	// the server: its ID is this test's own (other tests leave tasks named
	// t0 behind, in queues of their own).
	taskID := func(i int) string { return fmt.Sprint(queue, "-t", i) }
	const n = 16
	for i := range n {
		if _, err := client.Enqueue(asynq.NewTask("test:record", nil), asynq.Queue(queue), asynq.TaskID(taskID(i)), asynq.MaxRetry(5)); err != nil {
			t.Fatal(err)
		}
	}
	for i := range 3 {
		if _, err := client.Enqueue(asynq.NewTask("test:record", nil), asynq.Queue(idle), asynq.TaskID(fmt.Sprint("p", i))); err != nil {
			t.Fatal(err)
		}
	}
	twin := redistest.Queue(t, "twin")
	for _, q := range []string{idle, twin} {
		if _, err := client.Enqueue(asynq.NewTask("test:record", nil), asynq.Queue(q), asynq.TaskID(twin+"-both")); err != nil {
			t.Fatal(err)
		}
	}
	queues := redistest.Client(t) // asynq's Redis
	inspector := asynq.NewInspectorFromRedisClient(queues)
	testkit.WaitFor(t, 5*time.Second, "the worker to take every task", func() bool {
		info, err := inspector.GetQueueInfo(queue)
		return err == nil && info.Pending == 0 && info.Active == 0
	})
	all := served
	all.Queues = map[string]jobs.QueueConfig{queue: {Drain: drain}, idle: {Drain: drain}}
	ctx := context.Background()
	var booked, asking []jobs.TaskETA
	for i := range n {
		e, err := jobs.ETA(ctx, rdb, queues, all, "", taskID(i))
		if errors.As(err, new(*jobs.TaskNotFoundError)) {
			continue // it ran
		}
		if err != nil {
			t.Fatal(err)
		}
		switch e.State {
		case jobs.TaskBooked:
			booked = append(booked, e)
		case jobs.TaskAsksAgain:
			asking = append(asking, e)
		case jobs.TaskPending:
			// Back from Redis at its asking time with the others due then,
			// not yet taken again by the worker: a state a task passes
			// through, among the queue's tasks.
			if e.Position < 1 || e.Position > n {
				t.Errorf("task t%d: %+v, want it back among the queue's %d", i, e, n)
			}
		case jobs.TaskRunning:
			// Taken again, just before its turn, holding for it: another
			// state a task passes through (a make test run met one).
		default:
			t.Errorf("task t%d: %+v, want booked, asking again, back in pending, or run", i, e)
		}
	}
	t.Logf("%d booked, %d asking again", len(booked), len(asking))
	if len(booked) < 2 || len(asking) == 0 {
		t.Fatalf("%d booked and %d asking again, want both", len(booked), len(asking))
	}
	for _, e := range booked {
		if d := e.At.Sub(booked[0].At); d%(500*time.Millisecond) != 0 || e.At.Sub(e.Now) > reserveMax {
			t.Errorf("task %s booked at %v, %v from the first: want 500 ms steps, within %v", e.ID, e.At, d, reserveMax)
		}
	}
	for _, e := range asking {
		// Refused a turn within 5 s, it asks again in 1 s or more, or at
		// its backlog line's ticket (the waker may be about to take it).
		if d := e.At.Sub(e.Now); d < -time.Second || d > 10*time.Second {
			t.Errorf("task %s asks again in %v, want within 10 s", e.ID, d)
		}
	}
	for i := range 3 {
		e, err := jobs.ETA(ctx, rdb, queues, all, idle, fmt.Sprint("p", i))
		if err != nil {
			t.Fatal(err)
		}
		want := e.Now.Add(time.Duration(e.Position-1) * 500 * time.Millisecond)
		if e.State != jobs.TaskPending || e.Position != i+1 || !e.At.Equal(want) {
			t.Errorf("task p%d: %+v, want pending at position %d, predicted %v", i, e, i+1, want)
		}
	}
	_, err := jobs.ETA(ctx, rdb, queues, all, "", "nope")
	var missing *jobs.TaskNotFoundError
	if !errors.As(err, &missing) || missing.ID != "nope" || len(missing.Queues) < 2 {
		t.Errorf("ETA of an unknown id: %v, want a TaskNotFoundError naming it and both queues", err)
	}
	_, err = jobs.ETA(ctx, rdb, queues, all, "", twin+"-both")
	var ambiguous *jobs.AmbiguousTaskError
	if !errors.As(err, &ambiguous) || !slices.Equal(slices.Sorted(slices.Values(ambiguous.Queues)), slices.Sorted(slices.Values([]string{idle, twin}))) {
		t.Errorf("ETA of an id two queues hold: %v, want an AmbiguousTaskError naming %s and %s", err, idle, twin)
	}
}
