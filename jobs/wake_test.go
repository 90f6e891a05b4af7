package jobs

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/algorithms"
	"github.com/sluicehq/sluice/internal/redistest"
	"github.com/sluicehq/sluice/internal/testkit"
)

// TestWakerOnTime: of two workers, one at a time moves the tasks that wait
// in Redis to pending, each when it is due (up to wakeEvery early, never
// more than the waker's longest sleep late), whichever worker noted it; when
// the waker stops, the other takes over at once (the stopped one says it
// resigned: the other does not wait for its next watch, wakeWatch later)
// and the tasks still come on time.
func TestWakerOnTime(t *testing.T) {
	queue := redistest.Queue(t, "q")
	cfg := Config{Queues: map[string]QueueConfig{queue: {}}}
	workers := []*Scheduler{newTestScheduler(t, cfg), newTestScheduler(t, cfg)}
	for i, s := range workers {
		s.worker += fmt.Sprintf("/%d", i) // two workers of one process
		s.waker.worker = s.worker         // its services took the name it had
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
		if err := workers[i%2].waker.note(context.Background(), queue, id, wait, time.Time{}); err != nil {
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
			s.waker.run(ctx)
		}()
		go s.board.run(ctx) // hears a waker that resigned
		defer cancel()
	}
	// Both subscribed before a waker may resign.
	testkit.WaitFor(t, 5*time.Second, "both workers subscribed to the fleet's notices", func() bool {
		n, err := redistest.Client(t).PubSubNumSub(context.Background(), blockChannel).Result()
		return err == nil && n[blockChannel] >= 2
	})

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
				if _, ok := s.waker.wakerOf.Load(queue); ok {
					ctxs[i]()
					<-stopped[i]
					stoppedAt = time.Now()
					wokenAtStop = [2]float64{testutil.ToFloat64(workers[0].metrics.woken), testutil.ToFloat64(workers[1].metrics.woken)}
					t.Logf("worker %d, the waker, stopped after %d tasks", i, len(pendingAt))
					// Only the one: the other may be the waker already
					// (it heard the stopped one resign), and must stay.
					break
				}
			}
		}
	}
	if stoppedAt.IsZero() {
		t.Fatal("no worker was the waker half-way")
	}
	// The notice's way to the other worker and its look, on a loaded
	// machine: far less than wakeWatch.
	const handover = 150 * time.Millisecond
	for id, at := range due {
		got, ok := pendingAt[id]
		switch {
		case !ok:
			t.Errorf("%s never became pending", id)
		case got.Before(at.Add(-wakeEvery - 5*time.Millisecond)):
			t.Errorf("%s pending %v early, want at most %v", id, at.Sub(got), wakeEvery)
		case at.Before(stoppedAt) && got.After(at.Add(wakeEvery)):
			t.Errorf("%s pending %v late, want at most %v", id, got.Sub(at), wakeEvery)
		case got.After(at.Add(wakeEvery + handover)):
			// Due just after the waker stopped: the other looks as it
			// hears so, not at its next watch.
			t.Errorf("%s pending %v late after the waker stopped, want at most %v (the other told it resigned; it watches every %v)", id, got.Sub(at), wakeEvery+handover, wakeWatch)
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

// TestHeldTaskBooksAgainOnReload: tasks waiting in the worker for turns
// booked at the old rate (tasks without retries wait there up to
// worker.reserve_max) book again when a config with a faster limit comes
// into force, instead of running at the old rate.
func TestHeldTaskBooksAgainOnReload(t *testing.T) {
	t.Parallel()
	queue := redistest.Queue(t, "q")
	cfg := func(perSecond int) Config {
		return Config{
			Worker: WorkerConfig{Concurrency: 10},
			Queues: map[string]QueueConfig{queue: {Drain: &LimitConfig{Limit: perSecond, Period: time.Second, Burst: 1}}},
		}
	}
	s := newTestScheduler(t, cfg(1))
	ran := make(chan time.Time, 10)
	mux := asynq.NewServeMux()
	mux.Use(s.Middleware)
	mux.HandleFunc("test:record", func(context.Context, *asynq.Task) error {
		ran <- time.Now()
		return nil
	})
	client := serve(t, s, mux)
	for range 6 {
		if _, err := client.Enqueue(asynq.NewTask("test:record", nil), asynq.Queue(queue), asynq.MaxRetry(0)); err != nil {
			t.Fatal(err)
		}
	}
	<-ran // the first, at once; the other five hold turns up to 5s ahead
	time.Sleep(300 * time.Millisecond)
	changed := time.Now()
	if err := s.Apply(cfg(50)); err != nil {
		t.Fatal(err)
	}
	for i := range 5 {
		select {
		case at := <-ran:
			if late := at.Sub(changed); late > time.Second {
				t.Fatalf("task %d ran %v after the drain went to 50/s: it kept its turn at 1/s", i+2, late.Round(time.Millisecond))
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("task %d did not run", i+2)
		}
	}
}

// TestWarm: before the first task, Warm loads the scripts the gates and
// the wake set run on the server that holds them: the gates' as functions
// on a server that has them (Redis 7), the wake set's as a script.
func TestWarm(t *testing.T) {
	rdb := redis.NewClient(&redis.Options{Addr: redistest.StartServer(t).Addr})
	defer rdb.Close()
	queue := redistest.Queue(t, "q")
	s := newScheduler(t, rdb, Config{
		Queues: map[string]QueueConfig{queue: {Drain: &LimitConfig{Limit: 5, Period: time.Second, Burst: 1}}},
	})
	ctx := context.Background()
	loaded := func() (functions bool, wake bool) {
		t.Helper()
		libraries, err := rdb.Do(ctx, "FUNCTION", "LIST", "LIBRARYNAME", algorithms.BookScript.Function()).Slice()
		if err != nil {
			t.Fatal(err)
		}
		scripts, err := rdb.ScriptExists(ctx, wakeScript.Hash()).Result()
		if err != nil {
			t.Fatal(err)
		}
		return len(libraries) > 0, scripts[0]
	}
	if functions, wake := loaded(); functions || wake {
		t.Fatalf("loaded before Warm: the gates' functions %v, the wake script %v", functions, wake)
	}
	if err := s.Warm(ctx); err != nil {
		t.Fatal(err)
	}
	if functions, wake := loaded(); !functions || !wake {
		t.Errorf("loaded after Warm: the gates' functions %v, the wake script %v; want both", functions, wake)
	}
}

// TestWakeWhileStillActive: a task noted in the wake set just before asynq
// moves it from its active list to the retry list (a turn a few ms past
// requeueLead) is not lost to the waker's look in between: it becomes
// pending when due, not when asynq's own schedule says.
func TestWakeWhileStillActive(t *testing.T) {
	queue := redistest.Queue(t, "q")
	s := newTestScheduler(t, Config{Queues: map[string]QueueConfig{queue: {}}})
	ctx := context.Background()
	noted, release := make(chan struct{}), make(chan struct{})
	mux := asynq.NewServeMux()
	mux.HandleFunc("test:wait", func(ctx context.Context, task *asynq.Task) error {
		id, _ := asynq.GetTaskID(ctx)
		if err := s.waker.note(ctx, queue, id, 0, time.Time{}); err != nil {
			return err
		}
		close(noted)
		<-release
		return &waitError{wait: time.Hour} // asynq's own schedule: an hour
	})
	srv := asynq.NewServer(asynq.RedisClientOpt{Addr: redistest.Addr(t)}, s.AsynqConfig())
	if err := srv.Start(mux); err != nil {
		t.Fatal(err)
	}
	defer srv.Shutdown()
	client := asynq.NewClient(asynq.RedisClientOpt{Addr: redistest.Addr(t)})
	defer client.Close()
	if _, err := client.Enqueue(asynq.NewTask("test:wait", nil), asynq.Queue(queue), asynq.TaskID("w")); err != nil {
		t.Fatal(err)
	}
	<-noted
	// The look while the task still runs...
	s.waker.wakeQueue(ctx, queue)
	close(release)
	// ...and the looks after: the task is pending within a second.
	srv.Stop() // takes no more tasks, so pending stays pending
	deadline := time.Now().Add(time.Second)
	for {
		s.waker.wakeQueue(ctx, queue)
		info, err := s.inspector.GetTaskInfo(queue, "w")
		if err == nil && info.State == asynq.TaskStatePending {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the task is %v a second after it was due (%v), want pending", info.State, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestWakerLooksInBatches (issue 12, Redis cost per waiting task): tasks due
// back every 10ms (a queue drained at 100/s) are moved to pending by looks
// at least wakeEvery apart, each taking every task due within wakeEvery,
// not by one look per task. And (issue 20, commands per task) a look that
// does not renew the waker's lease reads neither the lease nor Redis's
// clock (its now is reckoned from the last that did): a look is a script
// run and 3 commands with a task to move, where it was 5 or 6; only the
// renewals, every half a lease, read TIME.
func TestWakerLooksInBatches(t *testing.T) {
	queue := redistest.Queue(t, "q")
	rdb := redistest.Client(t)
	looks := &scriptCalls{op: "take"}
	rdb.AddHook(looks)
	s := newScheduler(t, rdb, Config{Queues: map[string]QueueConfig{queue: {}}})
	client := asynq.NewClient(asynq.RedisClientOpt{Addr: redistest.Addr(t)})
	defer client.Close()

	const n, every = 100, 10 * time.Millisecond
	for i := range n {
		id := fmt.Sprintf("task-%d", i)
		if _, err := client.Enqueue(asynq.NewTask("test:record", nil), asynq.Queue(queue), asynq.TaskID(id), asynq.ProcessIn(time.Hour)); err != nil {
			t.Fatal(err)
		}
	}
	// Noted as a task that just booked its turn is: at an instant on
	// Redis's clock.
	start := time.Now()
	redisNow, err := rdb.Time(context.Background()).Result()
	if err != nil {
		t.Fatal(err)
	}
	for i := range n {
		wait := 200*time.Millisecond + time.Duration(i)*every
		if err := s.waker.note(context.Background(), queue, fmt.Sprintf("task-%d", i), wait, redisNow.Add(wait)); err != nil {
			t.Fatal(err)
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	looks.count.Store(0)
	go s.waker.run(ctx)
	testkit.WaitFor(t, 5*time.Second, "every task moved to pending", func() bool {
		return testutil.ToFloat64(s.metrics.woken) == n
	})
	span := time.Since(start)
	if last := 200*time.Millisecond + (n-1)*every - wakeEvery - 10*time.Millisecond; span < last {
		t.Fatalf("every task pending %v after the first note, want the last one not before %v (its due instant less wakeEvery)", span, last)
	}
	// One look per wakeEvery while tasks are due, and a few more: the
	// first, and the one that finds the set empty.
	most := int64(span/wakeEvery) + 3
	t.Logf("%d tasks due over %v moved by %d looks in %v", n, n*every, looks.count.Load(), span.Round(time.Millisecond))
	if got := looks.count.Load(); got > most {
		t.Errorf("%d looks moved %d tasks due over %v, want at most %d (one per %v)", got, n, n*every, most, wakeEvery)
	}
	// The first look, and one at each renewal of the lease.
	renewals := int64(span/(wakeLease/2)) + 2
	if got := looks.timeReads.Load(); got > renewals {
		t.Errorf("%d of %d looks in %v read Redis's clock, want at most %d (the first, and one each %v when the lease is renewed)", got, looks.count.Load(), span.Round(time.Millisecond), renewals, wakeLease/2)
	}
}

// TestWakerWatchCost (issue 20, commands per task): the workers that are
// not a queue's waker ask whether its lease lapsed once every wakeWatch,
// a GET each, where they asked 4 times a second (0.5 commands a task of a
// fleet of 3 draining 20 a second); the waker renews its lease every half
// a lease (a GET and a PEXPIRE while nothing is due).
func TestWakerWatchCost(t *testing.T) {
	queue := redistest.Queue(t, "q")
	cfg := Config{Queues: map[string]QueueConfig{queue: {}}}
	gets := &scriptCalls{command: "get"}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	for i := range 3 {
		rdb := redistest.Client(t)
		rdb.AddHook(gets)
		s := newScheduler(t, rdb, cfg)
		s.worker += fmt.Sprintf("/%d", i)
		s.waker.worker = s.worker
		wg.Go(func() { s.waker.run(ctx) })
	}
	const span = 3 * time.Second
	time.Sleep(time.Second) // one of them is the waker
	gets.count.Store(0)
	time.Sleep(span)
	got := gets.count.Load()
	watches := 2 * (int64(span/time.Second) + 1) // a second apart, not wakeWatch: the test holds the constant too
	renewals := int64(span/(wakeLease/2)) + 1
	t.Logf("3 wakers of one idle queue: %d GETs in %v", got, span)
	if got > watches+renewals {
		t.Errorf("3 wakers of one idle queue sent %d GETs in %v, want at most %d: the waker's renewals (%d) and the others' watches, one a second each (%d)", got, span, watches+renewals, renewals, watches)
	}
}

// scriptCalls counts the script runs (EVALSHA or EVAL) whose arguments
// include op; with command set, the commands of that name instead.
// timeReads counts the runs counted that read Redis's clock (TIME: their
// first argument, now, is empty).
type scriptCalls struct {
	op, command string
	count       atomic.Int64
	timeReads   atomic.Int64
}

func (c *scriptCalls) DialHook(next redis.DialHook) redis.DialHook { return next }

func (c *scriptCalls) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		// An EVALSHA refused NOSCRIPT (another package's tests flush the
		// shared server's scripts) is sent again as EVAL: one run, counted
		// once.
		if err != nil && strings.HasPrefix(err.Error(), "NOSCRIPT") {
			return err
		}
		name := cmd.Name()
		if c.command != "" && name == c.command ||
			c.command == "" && (name == "evalsha" || name == "eval") && slices.Contains(cmd.Args(), any(c.op)) {
			c.count.Add(1)
			// EVALSHA sha numkeys keys... now op ...
			if args := cmd.Args(); c.command == "" && len(args) > 2 {
				if numKeys, ok := args[2].(int); ok && len(args) > 3+numKeys && args[3+numKeys] == "" {
					c.timeReads.Add(1)
				}
			}
		}
		return err
	}
}

func (c *scriptCalls) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		for _, cmd := range cmds {
			_ = c.ProcessHook(func(context.Context, redis.Cmder) error { return nil })(ctx, cmd)
		}
		return next(ctx, cmds)
	}
}

// TestBookingNotesWaitingTask (issue 12, one trip per waiting task): a
// task whose turn is too far to wait for in the worker is noted in the
// wake set by its booking's own script run, not by a second one; it comes
// back on time and runs once.
func TestBookingNotesWaitingTask(t *testing.T) {
	t.Parallel()
	queue := redistest.Queue(t, "q")
	rdb := redistest.Client(t)
	notes := &scriptCalls{op: "note"}
	rdb.AddHook(notes)
	s := newScheduler(t, rdb, Config{
		Worker: WorkerConfig{Concurrency: 10, HoldMax: time.Nanosecond},
		Queues: map[string]QueueConfig{queue: {Drain: &LimitConfig{Limit: 2, Period: time.Second, Burst: 1}}},
	})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go s.Run(ctx)
	var ran sync.Map
	mux := asynq.NewServeMux()
	mux.Use(s.Middleware)
	mux.HandleFunc("test:record", func(ctx context.Context, task *asynq.Task) error {
		id, _ := asynq.GetTaskID(ctx)
		if _, again := ran.LoadOrStore(id, time.Now()); again {
			t.Errorf("task %s ran twice", id)
		}
		return nil
	})
	client := serve(t, s, mux)
	// At 2/s, the tasks after the first one or two have turns further than
	// a worker holds for (alwaysHold): they wait in Redis. (At 10/s, in a
	// make test run on a loaded machine, the workers took the tasks so
	// slowly that only 4 of 12 turns were still that far when booked.)
	const n = 12
	for i := range n {
		if _, err := client.Enqueue(asynq.NewTask("test:record", nil), asynq.Queue(queue), asynq.TaskID(fmt.Sprint("t", i)), asynq.MaxRetry(5)); err != nil {
			t.Fatal(err)
		}
	}
	testkit.WaitFor(t, 20*time.Second, "every task to run", func() bool {
		count := 0
		ran.Range(func(any, any) bool { count++; return true })
		return count == n
	})
	requeued := testutil.ToFloat64(s.metrics.throttled.WithLabelValues(queue, "requeued"))
	t.Logf("%d tasks, %.0f waited in Redis, %d separate notes", n, requeued, notes.count.Load())
	if requeued < n/2 {
		t.Fatalf("%.0f of %d tasks waited in Redis, want at least %d: the test shows nothing", requeued, n, n/2)
	}
	if got := notes.count.Load(); got != 0 {
		t.Errorf("%d notes in the wake set by a script run of their own, want none: each booking notes its task", got)
	}
}

// TestWakerTakesBackItsOwnLease: a waker whose take failed (a master
// failing over: it no longer knows it holds the lease, which the promoted
// replica still has in its name) is the waker again at its next look. It
// waited for its own lease to lapse before (the lease's PTTL looked like
// another worker's): up to a second with no waker after a failover, and
// TestClusterFailover's drain 18.7/s instead of 20 after the promotion.
func TestWakerTakesBackItsOwnLease(t *testing.T) {
	queue := redistest.Queue(t, "q")
	s := newTestScheduler(t, Config{Queues: map[string]QueueConfig{queue: {}}})
	ctx := context.Background()
	l := &wakeLook{}
	s.waker.look(ctx, queue, l)
	if !l.held {
		t.Fatal("the only worker is not the waker after its first look")
	}
	l.held = false // its take failed; the lease in Redis is still its own
	if d := s.waker.look(ctx, queue, l); !l.held {
		t.Errorf("a waker that lost track of its own lease is not the waker at its next look (looks again in %v)", d)
	}
}

// TestWakerPushesInTurnOrder: the tasks one look brings back (up to
// wakeBatch) go to pending with the earliest due at the right end, which
// asynq takes first, on the limits' server (wake.lua moves them) and apart
// from it (ready.lua). A worker short of free slots takes them one by one
// as slots free: pushed in the order due, the last due came first and the
// first waited, and at 300/s some came after their turns
// (TestShardedQueue). A later look's tasks still go to the right of an
// earlier one's not taken yet: see defaultWaiting.
func TestWakerPushesInTurnOrder(t *testing.T) {
	for _, moves := range []bool{true, false} {
		t.Run(fmt.Sprintf("moves=%v", moves), func(t *testing.T) {
			queue := redistest.Queue(t, "q")
			rdb := redistest.Client(t)
			s := newScheduler(t, rdb, Config{Queues: map[string]QueueConfig{queue: {}}})
			s.waker.moves = moves
			client := asynq.NewClient(asynq.RedisClientOpt{Addr: redistest.Addr(t)})
			defer client.Close()
			const n = wakeBatch
			ids := make([]string, n)
			for i := range ids {
				ids[i] = fmt.Sprintf("task-%03d", i)
				if _, err := client.Enqueue(asynq.NewTask("test:record", nil), asynq.Queue(queue), asynq.TaskID(ids[i]), asynq.ProcessIn(time.Hour)); err != nil {
					t.Fatal(err)
				}
			}
			redisNow, err := rdb.Time(context.Background()).Result()
			if err != nil {
				t.Fatal(err)
			}
			// Due within a millisecond, in reverse order of their names'
			// numbers as noted: one look takes them all.
			for i := n - 1; i >= 0; i-- {
				at := redisNow.Add(50*time.Millisecond + time.Duration(i)*time.Microsecond)
				if err := s.waker.note(context.Background(), queue, ids[i], time.Until(at), at); err != nil {
					t.Fatal(err)
				}
			}
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			go s.waker.run(ctx)
			testkit.WaitFor(t, 5*time.Second, "every task moved to pending", func() bool {
				return testutil.ToFloat64(s.metrics.woken) == n
			})
			pending, err := rdb.LRange(context.Background(), asynqKeys(queue)+"pending", 0, -1).Result()
			if err != nil {
				t.Fatal(err)
			}
			slices.Reverse(pending) // asynq takes the right end first
			if !slices.Equal(pending, ids) {
				t.Errorf("pending, in the order asynq takes it: %v ... %v, want %v ... %v (the earliest due first)", pending[:3], pending[n-3:], ids[:3], ids[n-3:])
			}
		})
	}
}

// slowTimeReads delays the answer of every waker take that reads Redis's
// clock (its now argument empty) by delay: a slow Redis, or a slow way back.
type slowTimeReads struct{ delay time.Duration }

func (h slowTimeReads) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h slowTimeReads) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		args := cmd.Args()
		if name := cmd.Name(); (name == "evalsha" || name == "eval") && len(args) > 2 && slices.Contains(args, any("take")) {
			if numKeys, ok := args[2].(int); ok && len(args) > 3+numKeys && args[3+numKeys] == "" {
				time.Sleep(h.delay)
			}
		}
		return err
	}
}

func (h slowTimeReads) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// TestWakerReckonsEarlyNotLate: the looks between two renewals reckon
// Redis's clock from the last take that read it, from when that take was
// sent: an answer 300ms slow leaves the reckoning right, and a slow
// request (here the first call, refused NOSCRIPT, then sent again) puts it
// ahead of Redis's clock (tasks taken early wait in the worker), never
// behind. Reckoned from when the answer came, the looks ran 300ms behind
// and took tasks after their turns' lead was spent. (Redis and this test
// share one clock.)
func TestWakerReckonsEarlyNotLate(t *testing.T) {
	queue := redistest.Queue(t, "q")
	rdb := redistest.Client(t)
	rdb.AddHook(slowTimeReads{delay: 300 * time.Millisecond})
	s := newScheduler(t, rdb, Config{Queues: map[string]QueueConfig{queue: {}}})
	l := &wakeLook{}
	if _, held, _ := s.waker.take(context.Background(), queue, true, l); !held {
		t.Fatal("the only worker is not the waker")
	}
	ahead := time.Duration(l.ahead) * time.Microsecond
	t.Logf("after a take answered 300ms late, Redis's clock is reckoned %v ahead of ours", ahead)
	if ahead < -5*time.Millisecond || ahead > 400*time.Millisecond {
		t.Errorf("after a take answered 300ms late, Redis's clock is reckoned %v ahead of ours (they are one clock), want 0 to 400ms: ahead, never behind", ahead)
	}
}
