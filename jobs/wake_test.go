package jobs

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/sluicehq/sluice/internal/redistest"
)

// TestWakerOnTime: of two workers, one at a time moves the tasks that wait
// in Redis to pending, each when it is due (up to wakeAhead early, never
// more than the waker's longest sleep late), whichever worker noted it; when
// the waker stops, the other takes over and the tasks still come on time.
func TestWakerOnTime(t *testing.T) {
	queue := redistest.Queue(t, "q")
	cfg := Config{Queues: map[string]QueueConfig{queue: {}}}
	workers := []*Scheduler{newTestScheduler(t, cfg), newTestScheduler(t, cfg)}
	for i, s := range workers {
		s.worker += fmt.Sprintf("/%d", i) // two workers of one process
	}
	client := asynq.NewClient(asynq.RedisClientOpt{Addr: redistest.Addr(t)})
	defer client.Close()
	inspector := asynq.NewInspector(asynq.RedisClientOpt{Addr: redistest.Addr(t)})
	defer inspector.Close()

	// Tasks scheduled an hour ahead, so that asynq never brings them
	// itself; each noted due at its own instant, by either worker.
	const n = 16
	start := time.Now()
	due := map[string]time.Time{}
	for i := range n {
		id := fmt.Sprintf("task-%d", i)
		if _, err := client.Enqueue(asynq.NewTask("test:record", nil), asynq.Queue(queue), asynq.TaskID(id), asynq.ProcessIn(time.Hour)); err != nil {
			t.Fatal(err)
		}
		wait := time.Duration(300+150*i)*time.Millisecond - time.Since(start)
		due[id] = time.Now().Add(wait)
		if err := workers[i%2].noteWake(context.Background(), queue, id, wait); err != nil {
			t.Fatal(err)
		}
	}
	ctxs := make([]context.CancelFunc, 2)
	stopped := make([]chan struct{}, 2)
	for i, s := range workers {
		ctx, cancel := context.WithCancel(context.Background())
		ctxs[i], stopped[i] = cancel, make(chan struct{})
		go func() {
			defer close(stopped[i])
			s.wake(ctx)
		}()
		defer cancel()
	}

	// Watch the tasks become pending; half-way, stop the waker.
	pendingAt := map[string]time.Time{}
	stoppedAt := time.Time{}
	var wokenAtStop [2]float64
	for deadline := time.Now().Add(10 * time.Second); len(pendingAt) < n && time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
		tasks, err := inspector.ListPendingTasks(queue, asynq.PageSize(n))
		if err != nil {
			t.Fatal(err)
		}
		for _, task := range tasks {
			if _, seen := pendingAt[task.ID]; !seen {
				pendingAt[task.ID] = time.Now()
			}
		}
		if stoppedAt.IsZero() && len(pendingAt) >= n/2 {
			for i, s := range workers {
				if _, ok := s.wakerOf.Load(queue); ok {
					ctxs[i]()
					<-stopped[i]
					stoppedAt = time.Now()
					wokenAtStop = [2]float64{testutil.ToFloat64(workers[0].metrics.woken), testutil.ToFloat64(workers[1].metrics.woken)}
					t.Logf("worker %d, the waker, stopped after %d tasks", i, len(pendingAt))
				}
			}
		}
	}
	if stoppedAt.IsZero() {
		t.Fatal("no worker was the waker half-way")
	}
	for id, at := range due {
		got, ok := pendingAt[id]
		switch {
		case !ok:
			t.Errorf("%s never became pending", id)
		case got.Before(at.Add(-wakeAhead - 5*time.Millisecond)):
			t.Errorf("%s pending %v early, want at most %v", id, at.Sub(got), wakeAhead)
		case at.Before(stoppedAt) && got.After(at.Add(wakeMaxIdle)):
			t.Errorf("%s pending %v late, want at most %v", id, got.Sub(at), wakeMaxIdle)
		case got.After(at.Add(wakeWatch + wakeMaxIdle)):
			// Due just after the waker stopped: the other looks within
			// wakeWatch.
			t.Errorf("%s pending %v late after the waker stopped, want at most %v", id, got.Sub(at), wakeWatch+wakeMaxIdle)
		}
	}
	// One waker at a time: until it stopped, only one worker moved tasks;
	// then the other moved the rest.
	woken := [2]float64{testutil.ToFloat64(workers[0].metrics.woken), testutil.ToFloat64(workers[1].metrics.woken)}
	t.Logf("tasks moved by each worker: %v when the waker stopped, %v in all", wokenAtStop, woken)
	if (wokenAtStop[0] > 0) == (wokenAtStop[1] > 0) || woken[0]+woken[1] != n || woken[0] == 0 || woken[1] == 0 {
		t.Errorf("tasks moved by each worker: %v when the waker stopped, %v in all; want all %d, by one worker until it stopped and by the other after", wokenAtStop, woken, n)
	}
}
