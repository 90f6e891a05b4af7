package jobs

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/sluicehq/sluice/internal/redistest"
)

func newTestScheduler(t *testing.T, cfg Config) *Scheduler {
	t.Helper()
	s, err := NewScheduler(redistest.Client(t), asynq.RedisClientOpt{Addr: redistest.Addr(t)}, cfg,
		NewMetrics(prometheus.NewRegistry()), slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

// TestWorkerDeathCounts (9.6): the death of the worker running a task is
// counted as the task's failure (it spends a retry), while waiting is not;
// a task without retries that asynq archived after its worker died runs
// again once, and stays archived after a second death.
func TestWorkerDeathCounts(t *testing.T) {
	queue := redistest.Queue(t, "q")
	s := newTestScheduler(t, Config{Queues: map[string]QueueConfig{queue: {}}})
	isFailure := s.AsynqConfig().IsFailure
	if !isFailure(asynq.ErrLeaseExpired) {
		t.Error("a worker death is not counted: a task that kills its worker would run for ever")
	}
	if isFailure(&waitError{wait: time.Second}) || isFailure(errWaitInRedis) {
		t.Error("waiting for a turn counted as a failure")
	}
	// An archived task, as asynq leaves one whose worker died: archived
	// from the schedule (the same lists and state).
	client := asynq.NewClient(asynq.RedisClientOpt{Addr: redistest.Addr(t)})
	defer client.Close()
	info, err := client.Enqueue(asynq.NewTask("test:poison", nil), asynq.Queue(queue), asynq.MaxRetry(0), asynq.ProcessIn(time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	died := func() *asynq.TaskInfo {
		t.Helper()
		if err := s.inspector.ArchiveTask(queue, info.ID); err != nil {
			t.Fatal(err)
		}
		archived, err := s.inspector.GetTaskInfo(queue, info.ID)
		if err != nil {
			t.Fatal(err)
		}
		archived.LastErr = asynq.ErrLeaseExpired.Error()
		return archived
	}
	ctx := context.Background()
	if !s.rescue(ctx, queue, died()) {
		t.Fatal("a task archived after one worker death was not run again")
	}
	if st, err := s.inspector.GetTaskInfo(queue, info.ID); err != nil || st.State != asynq.TaskStatePending {
		t.Fatalf("after a rescue the task is %v (%v), want pending", st.State, err)
	}
	again := died()
	if s.rescue(ctx, queue, again) {
		t.Fatal("a task archived after a second worker death was run again")
	}
	if st, err := s.inspector.GetTaskInfo(queue, info.ID); err != nil || st.State != asynq.TaskStateArchived {
		t.Fatalf("after the second death the task is %v (%v), want archived", st.State, err)
	}
	withRetries := *again
	withRetries.ID = "another"
	withRetries.MaxRetry = 3
	if s.rescue(ctx, queue, &withRetries) {
		t.Fatal("a task with retries, archived when they were spent on worker deaths, was run again")
	}
}

// TestCostAboveCapacity (9.7): a task type whose cost no gate can ever
// admit at once is refused at start and on reload, naming tasks.<type>.cost
// and the gate.
func TestCostAboveCapacity(t *testing.T) {
	cfg := Config{
		Queues: map[string]QueueConfig{"q": {Drain: &LimitConfig{Limit: 5, Period: time.Second, Burst: 2}}},
		Quotas: map[string]LimitConfig{"api": {Limit: 10, Period: time.Second, Burst: 3}},
		Tasks:  map[string]TaskConfig{"t": {Quotas: []string{"api"}, Cost: 4}},
	}
	var msgs []string
	for _, err := range cfg.Defaults().Validate() {
		msgs = append(msgs, err.Error())
	}
	all := strings.Join(msgs, "\n")
	for _, want := range []string{`tasks.t.cost: 4 is more than quota "api" can ever admit at once (3)`, "tasks.t.cost: 4 is more than queues.q.drain can ever admit at once (2)"} {
		if !strings.Contains(all, want) {
			t.Errorf("problems:\n%s\nwant one saying %q", all, want)
		}
	}
	s := newTestScheduler(t, Config{Queues: map[string]QueueConfig{"q": {}}})
	cfg.Tasks["t"] = TaskConfig{Quotas: []string{"api"}, Cost: 4}
	if err := s.Apply(cfg); err == nil || !strings.Contains(err.Error(), "tasks.t.cost") {
		t.Errorf("Apply of a cost above capacity: %v, want refused naming tasks.t.cost", err)
	}
}

// TestReloadQueuesRefused (10.2): a reload that adds or removes a queue is
// refused with an error saying a restart is needed, and the config in force
// stays, its drains included.
func TestReloadQueuesRefused(t *testing.T) {
	drain := &LimitConfig{Limit: 2, Period: time.Second, Burst: 1}
	cfg := Config{Queues: map[string]QueueConfig{"a": {Drain: drain}, "b": {}}}
	s := newTestScheduler(t, cfg)
	for _, queues := range []map[string]QueueConfig{{"b": {}}, {"a": {Drain: drain}, "b": {}, "c": {}}} {
		err := s.Apply(Config{Queues: queues})
		if !errors.Is(err, ErrRestartNeeded) || !strings.Contains(err.Error(), "restart") {
			t.Errorf("Apply changing the queues: %v, want ErrRestartNeeded", err)
		}
		if g := s.gates.Load().drains["a"]; g == nil {
			t.Fatal("queue a lost its drain after a refused reload")
		}
	}
}
