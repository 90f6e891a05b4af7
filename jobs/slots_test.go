package jobs_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/internal/redistest"
	"github.com/sluicehq/sluice/internal/testkit"
	"github.com/sluicehq/sluice/jobs"
	"github.com/sluicehq/sluice/throttle"
)

// lease is the concurrency lease of these tests: short enough to end
// within a test.
const lease = 300 * time.Millisecond

// stoppable is a handler that runs for run, or until its context ends; it
// notes how many run at once, and counts the runs that finished.
type stoppable struct {
	run                 time.Duration
	running, most, done atomic.Int64
	stopped             atomic.Int64
}

func (h *stoppable) ProcessTask(ctx context.Context, t *asynq.Task) error {
	now := h.running.Add(1)
	defer h.running.Add(-1)
	for most := h.most.Load(); now > most && !h.most.CompareAndSwap(most, now); most = h.most.Load() {
	}
	select {
	case <-ctx.Done():
		h.stopped.Add(1)
		return ctx.Err()
	case <-time.After(h.run):
		h.done.Add(1)
		return nil
	}
}

// slotKey is the semaphore of queue's concurrency limit.
func slotKey(queue string) string { return throttle.Key("sluice:concurrency:", "queue:"+queue) }

// TestSlotLapsesWhileCutOff (10.4): a worker cut off from Redis for longer
// than its lease stops the task that holds the slot before the lease
// ends, so that the task another worker starts once the slot is free never
// runs beside it: at most 1 at once for a limit of 1.
func TestSlotLapsesWhileCutOff(t *testing.T) {
	t.Parallel() // it mostly waits: beside the package's other tests
	queue := redistest.Queue(t, "q")
	cfg := jobs.Config{
		Worker: jobs.WorkerConfig{Concurrency: 2, HoldMax: 100 * time.Millisecond},
		Queues: map[string]jobs.QueueConfig{queue: {Concurrency: 1}},
	}
	h := &stoppable{run: time.Second}
	cutOff, proxy := redistest.ProxiedClient(t)
	reg := prometheus.NewRegistry()
	startWorker(t, cutOff, cfg, jobs.NewMetrics(reg), h, jobs.WithSlotLease(lease))
	enqueue(t, queue, 1)
	testkit.WaitFor(t, 5*time.Second, "the first task to run", func() bool { return h.running.Load() == 1 })
	startWorker(t, redistest.Client(t), cfg, jobs.NewMetrics(prometheus.NewRegistry()), h, jobs.WithSlotLease(lease))
	enqueue(t, queue, 1)
	proxy.Cut()
	// The lease ends; the other worker takes the slot.
	time.Sleep(3 * lease)
	proxy.Mend()
	testkit.WaitFor(t, 20*time.Second, "both tasks to run to the end", func() bool { return h.done.Load() == 2 })
	if most := h.most.Load(); most != 1 {
		t.Fatalf("%d tasks ran at once against a concurrency limit of 1", most)
	}
	if h.stopped.Load() != 1 || counterSum(t, reg, "sluice_slots_lost_total") != 1 {
		t.Fatalf("%d tasks stopped, %v slots lost counted; want the cut-off task stopped and counted", h.stopped.Load(), counterSum(t, reg, "sluice_slots_lost_total"))
	}
	if info := redistest.QueueInfo(t, queue); info.Archived != 0 || info.Retry != 0 {
		t.Fatalf("queue after the run: %+v, want nothing archived or retrying", info)
	}
}

// TestSlotRenewAnswers (10.4): a running task whose renew finds its lease
// ended (a paused worker, a clock that jumped) takes the slot again if it
// is free, and is stopped if another task has it; either is counted.
func TestSlotRenewAnswers(t *testing.T) {
	t.Parallel() // it mostly waits: beside the package's other tests
	ctx := context.Background()
	cases := []struct {
		desc   string
		other  bool // another holder takes the slot once the task's lease is gone
		result string
	}{
		{"the slot is free: the task takes it again", false, "retaken"},
		{"another task has the slot: the task stops", true, "stopped"},
	}
	for _, c := range cases {
		t.Run(c.desc, func(t *testing.T) {
			queue := redistest.Queue(t, "q")
			cfg := jobs.Config{Queues: map[string]jobs.QueueConfig{queue: {Concurrency: 1}}}
			h := &stoppable{run: 4 * lease}
			reg := prometheus.NewRegistry()
			metrics := jobs.NewMetrics(reg)
			startWorker(t, redistest.Client(t), cfg, metrics, h, jobs.WithSlotLease(lease))
			rdb := redistest.Client(t)
			enqueue(t, queue, 1)
			testkit.WaitFor(t, 5*time.Second, "the task to run", func() bool { return h.running.Load() == 1 })
			// The lease ends: the task's holder is gone from the semaphore.
			pipe := rdb.TxPipeline()
			pipe.Del(ctx, slotKey(queue))
			if c.other {
				pipe.ZAdd(ctx, slotKey(queue), redis.Z{Score: 1e16, Member: "other"})
			}
			if _, err := pipe.Exec(ctx); err != nil {
				t.Fatal(err)
			}
			if c.other {
				testkit.WaitFor(t, 2*time.Second, "the task to stop", func() bool { return h.stopped.Load() == 1 })
				rdb.Del(ctx, slotKey(queue))
			}
			testkit.WaitFor(t, 10*time.Second, "the task to run to the end", func() bool { return h.done.Load() == 1 })
			lost := counterWith(t, reg, "sluice_slots_lost_total", map[string]string{"slot": "queue:" + queue, "result": c.result})
			if lost != 1 {
				t.Fatalf("sluice_slots_lost_total{result=%q} = %v, want 1", c.result, lost)
			}
		})
	}
}

// counterWith is the value of the counter name in reg with the labels.
func counterWith(t *testing.T, reg *prometheus.Registry, name string, labels map[string]string) float64 {
	t.Helper()
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
	metrics:
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if want, ok := labels[l.GetName()]; ok && want != l.GetValue() {
					continue metrics
				}
			}
			return m.GetCounter().GetValue()
		}
	}
	return 0
}

// TestSlotsRenewedWhileWaiting (10.4): a task that took its queue's slot
// and waits for its type's renews the one it took: after waiting longer
// than the lease, it still holds it.
func TestSlotsRenewedWhileWaiting(t *testing.T) {
	t.Parallel() // it mostly waits: beside the package's other tests
	ctx := context.Background()
	// A longer lease than the other slot tests': renews come every third of
	// it, and on a loaded machine a renew of a 300ms lease came too late.
	const lease = time.Second
	queue := redistest.Queue(t, "q")
	cfg := jobs.Config{
		Worker: jobs.WorkerConfig{HoldMax: 3 * lease},
		Queues: map[string]jobs.QueueConfig{queue: {Concurrency: 1}},
		Tasks:  map[string]jobs.TaskConfig{"test:record": {Concurrency: 1}},
	}
	rdb := redistest.Client(t)
	typeKey := throttle.Key("sluice:concurrency:", "type:test:record")
	if err := rdb.ZAdd(ctx, typeKey, redis.Z{Score: 1e16, Member: "other"}).Err(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { rdb.Del(ctx, typeKey) })
	startWorker(t, rdb, cfg, jobs.NewMetrics(prometheus.NewRegistry()), &stoppable{}, jobs.WithSlotLease(lease))
	enqueue(t, queue, 1)
	testkit.WaitFor(t, 5*time.Second, "the task to take its queue's slot", func() bool { return rdb.ZCard(ctx, slotKey(queue)).Val() == 1 })
	time.Sleep(lease + lease/2)
	leases, err := rdb.ZRangeWithScores(ctx, slotKey(queue), 0, -1).Result()
	if err != nil {
		t.Fatal(err)
	}
	now, err := rdb.Time(ctx).Result()
	if err != nil {
		t.Fatal(err)
	}
	if len(leases) != 1 || leases[0].Score <= float64(now.UnixMicro()) {
		t.Fatalf("after %v waiting for the type's slot, the queue's slot holds %v; want the task's lease, running at Redis time %d µs", lease+lease/2, leases, now.UnixMicro())
	}
}

// TestSlotConfig (10.4, 10.5): worker.hold_max is bounded below the lease
// of a concurrency slot, and concurrency_on_redis_error is wait (the
// default) or allow.
func TestSlotConfig(t *testing.T) {
	cases := []struct {
		desc string
		cfg  jobs.Config
		want string // the error, "" for none
	}{
		{"defaults", jobs.Config{Queues: map[string]jobs.QueueConfig{"q": {Concurrency: 1}}}, ""},
		{"hold_max at its bound", jobs.Config{Worker: jobs.WorkerConfig{HoldMax: 10 * time.Second}}, ""},
		{"hold_max past its bound", jobs.Config{Worker: jobs.WorkerConfig{HoldMax: 11 * time.Second}},
			"worker.hold_max: must be from 0 to 10s (a third of the 30s lease of a concurrency slot), got 11s"},
		{"queue policies", jobs.Config{Queues: map[string]jobs.QueueConfig{
			"a": {Concurrency: 1, ConcurrencyOnRedisError: "wait"}, "b": {Concurrency: 1, ConcurrencyOnRedisError: "allow"}}}, ""},
		{"queue policy deny", jobs.Config{Queues: map[string]jobs.QueueConfig{"q": {Concurrency: 1, ConcurrencyOnRedisError: "deny"}}},
			`queues.q.concurrency_on_redis_error: must be wait (the default) or allow, got "deny"`},
		{"type policy local", jobs.Config{Tasks: map[string]jobs.TaskConfig{"t": {Concurrency: 1, ConcurrencyOnRedisError: "local"}}},
			`tasks.t.concurrency_on_redis_error: must be wait (the default) or allow, got "local"`},
	}
	for _, c := range cases {
		t.Run(c.desc, func(t *testing.T) {
			errs := c.cfg.Defaults().Validate()
			switch {
			case c.want == "" && len(errs) > 0:
				t.Fatalf("Validate: %v, want no error", errs)
			case c.want != "" && (len(errs) != 1 || errs[0].Error() != c.want):
				t.Fatalf("Validate: %v, want %q", errs, c.want)
			}
		})
	}
}

// TestConcurrencyRedisRefused (10.5): the limits' Redis user may not touch
// the concurrency limit's keys (an ACL), so every Acquire fails while asynq
// and the other gates work. A queue limited to 1 at once then does what its
// concurrency_on_redis_error says, and counts it: wait keeps every task
// waiting in Redis (none runs, none is lost); allow runs them without the
// limit.
func TestConcurrencyRedisRefused(t *testing.T) {
	t.Parallel()
	cases := []struct {
		policy string
		check  func(t *testing.T, h *stoppable)
	}{
		{jobs.OnRedisErrorWait, func(t *testing.T, h *stoppable) {
			if n := h.done.Load() + h.stopped.Load(); n != 0 {
				t.Fatalf("%d tasks ran past a concurrency limit whose policy is wait", n)
			}
		}},
		{jobs.OnRedisErrorAllow, func(t *testing.T, h *stoppable) {
			if h.done.Load() != 4 || h.most.Load() < 2 {
				t.Fatalf("%d of 4 tasks ran, at most %d at once, past a concurrency limit of 1 whose policy is allow; want all, several at once", h.done.Load(), h.most.Load())
			}
		}},
	}
	for _, c := range cases {
		t.Run(c.policy, func(t *testing.T) {
			queue := redistest.Queue(t, "q")
			cfg := jobs.Config{Queues: map[string]jobs.QueueConfig{queue: {Concurrency: 1, ConcurrencyOnRedisError: c.policy}}}
			user, password := redistest.ACLUser(t, "asynq:*", "sluice:rate:*", "sluice:rescue:*", "sluice:wake:*")
			rdb := redis.NewClient(&redis.Options{Addr: redistest.Addr(t), Username: user, Password: password})
			t.Cleanup(func() { rdb.Close() })
			h := &stoppable{run: 300 * time.Millisecond}
			reg := prometheus.NewRegistry()
			startWorker(t, rdb, cfg, jobs.NewMetrics(reg), h)
			enqueue(t, queue, 4)
			time.Sleep(2 * time.Second)
			c.check(t, h)
			gate := map[string]string{"gate": "concurrency:queue:" + queue}
			if n := counterWith(t, reg, "sluice_redis_errors_total", gate); n == 0 {
				t.Fatal("no Redis error counted in sluice_redis_errors_total")
			}
			if n := counterWith(t, reg, "sluice_policy_fallbacks_total", map[string]string{"gate": gate["gate"], "policy": c.policy}); n == 0 {
				t.Fatalf("no fallback counted in sluice_policy_fallbacks_total{policy=%q}", c.policy)
			}
			info := redistest.QueueInfo(t, queue)
			if left := info.Pending + info.Active + info.Scheduled + info.Retry; int64(left)+h.done.Load() != 4 || info.Archived != 0 {
				t.Fatalf("%d ran, %d left, %d archived: want the 4 tasks run or still queued", h.done.Load(), left, info.Archived)
			}
		})
	}
}

// TestSameIDInTwoQueues (issue 19.3): asynq task IDs are unique per queue
// only, so the same ID in two queues is two tasks: with their type limited
// to 1 at once, they never run at the same time (on main both held the
// one holder, and 2 ran at once).
func TestSameIDInTwoQueues(t *testing.T) {
	t.Parallel()
	a, b := redistest.Queue(t, "a"), redistest.Queue(t, "b")
	cfg := jobs.Config{
		Queues: map[string]jobs.QueueConfig{a: {}, b: {}},
		Tasks:  map[string]jobs.TaskConfig{"test:record": {Concurrency: 1}},
	}
	h := &stoppable{run: 500 * time.Millisecond}
	fleet(t, cfg, 1, h)
	enqueue(t, a, 1, asynq.TaskID("order-42"))
	enqueue(t, b, 1, asynq.TaskID("order-42"))
	testkit.WaitFor(t, 10*time.Second, "both tasks", func() bool { return h.done.Load() == 2 })
	if most := h.most.Load(); most != 1 {
		t.Fatalf("%d tasks ran at once against their type's concurrency limit of 1", most)
	}
}
