package jobs

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/throttle"
)

const (
	// delayedTaskCheck is how often asynq moves due scheduled tasks to
	// pending (its default of 5s would make requeued tasks late).
	delayedTaskCheck = 100 * time.Millisecond
	// taskCheck is how long an idle asynq worker sleeps between looks at
	// empty queues: between half of it and one and a half times it.
	taskCheck = 100 * time.Millisecond
	// requeueLead schedules a requeued task this long before its turn: long
	// enough to become pending and be picked up by a worker that was idle,
	// which then waits the rest of the way.
	requeueLead = delayedTaskCheck + taskCheck*3/2 + 50*time.Millisecond
	// slotLease is the lease of a concurrency slot; a running task renews it
	// every third of it.
	slotLease = 30 * time.Second
	// redisRetry is how often a gate whose policy is deny asks Redis again.
	redisRetry = time.Second
)

// Scheduler puts every task through its gates before its handler runs: the
// drain gate of its queue, the quota gates of its type (each a rate limit
// on Redis, shared by the fleet), then the concurrency limits of its queue
// and type. A task that must wait gets its turn booked on every gate at
// once, and waits for it in the worker when it is near (Config.Worker
// HoldMax), or goes back to Redis scheduled for it and passes the gates
// without asking again when it comes back. It is never failed, retried or
// archived for having to wait.
//
// Use Middleware on the asynq.ServeMux, AsynqConfig for the asynq.Server,
// Run in the background, and Apply to change the config live.
type Scheduler struct {
	rdb       redis.UniversalClient
	client    *asynq.Client
	inspector *asynq.Inspector
	metrics   *Metrics
	log       *slog.Logger
	worker    string // this process, for concurrency leases

	gates   atomic.Pointer[gateSet]
	offset  atomic.Int64 // Redis's clock minus ours, ns
	workers atomic.Int64 // live workers in the fleet, last seen
	holding sync.Map     // queue -> *atomic.Int64: tasks waiting in this worker
	blocked sync.Map     // quota -> time.Time (our clock): an upstream said not before then
	done    rateCounter  // completions not yet added to the fleet's rate buckets
}

// blockChannel carries "<quota> <µs>" to every worker when an upstream
// said "not now": tasks that already hold a turn on the quota learn of it
// before they call (new turns are kept out by the quota's own block).
const blockChannel = "sluice:blocked"

// NewScheduler returns a Scheduler for cfg. rdb is where the limits live;
// asynqRedis is where the queues are (the same server, as asynq wants it).
func NewScheduler(rdb redis.UniversalClient, asynqRedis asynq.RedisConnOpt, cfg Config, m *Metrics, log *slog.Logger) (*Scheduler, error) {
	host, _ := os.Hostname()
	s := &Scheduler{
		rdb:       rdb,
		client:    asynq.NewClient(asynqRedis),
		inspector: asynq.NewInspector(asynqRedis),
		metrics:   m,
		log:       log,
		worker:    host + ":" + strconv.Itoa(os.Getpid()),
	}
	s.workers.Store(1)
	if err := s.Apply(cfg); err != nil {
		return nil, err
	}
	return s, nil
}

// Close releases the Scheduler's connections.
func (s *Scheduler) Close() error {
	return errors.Join(s.client.Close(), s.inspector.Close())
}

// Config returns the config in force.
func (s *Scheduler) Config() Config { return s.gates.Load().cfg }

// Apply puts cfg in force for every task that starts from now on; tasks
// already past their gates keep their turns. A cfg with problems is
// refused and the one in force stays.
func (s *Scheduler) Apply(cfg Config) error {
	cfg = cfg.Defaults()
	if errs := cfg.Validate(); len(errs) > 0 {
		return fmt.Errorf("jobs: config refused: %w", errors.Join(errs...))
	}
	gs, err := newGateSet(s.rdb, cfg)
	if err != nil {
		return err
	}
	if old := s.gates.Swap(gs); old != nil {
		if stale := changedTags(old, gs); len(stale) > 0 {
			go s.rebook(context.Background(), gs, stale)
		}
	}
	return nil
}

// changedTags lists the turn tags of old's gates whose limit changed in gs.
func changedTags(old, gs *gateSet) []string {
	var stale []string
	for _, pair := range [][2]map[string]*gate{{old.drains, gs.drains}, {old.quotas, gs.quotas}} {
		for name, g := range pair[0] {
			if now, ok := pair[1][name]; !ok || now.tag != g.tag {
				stale = append(stale, g.tag)
			}
		}
	}
	return stale
}

// rebook brings forward the tasks waiting in Redis for turns booked under
// a limit that has changed: they were scheduled at the old rate. Back in a
// worker, they book new turns at the new rate. One worker of the fleet does
// it for each change.
func (s *Scheduler) rebook(ctx context.Context, gs *gateSet, stale []string) {
	claim := throttle.Key("sluice:rebook:", strings.Join(stale, ","))
	if ok, err := s.rdb.SetNX(ctx, claim, s.worker, time.Minute).Result(); err != nil || !ok {
		return
	}
	moved := 0
	for queue := range gs.cfg.Queues {
		// List first, then move: moving while paging would shift the pages.
		var ids []string
		for page := 1; ; page++ {
			tasks, err := s.inspector.ListScheduledTasks(queue, asynq.PageSize(500), asynq.Page(page))
			if err != nil {
				s.log.Warn("cannot bring forward tasks booked at an old rate", "queue", queue, "err", err)
				break
			}
			for _, t := range tasks {
				turns := readTurns(t.Headers)
				if slices.ContainsFunc(stale, func(tag string) bool { _, ok := turns[tag]; return ok }) {
					ids = append(ids, t.ID)
				}
			}
			if len(tasks) < 500 {
				break
			}
		}
		for _, id := range ids {
			if s.inspector.RunTask(queue, id) == nil {
				moved++
			}
		}
	}
	s.log.Info("limits changed: tasks booked at the old rate book again", "gates", stale, "tasks", moved)
}

// AsynqConfig returns the asynq.Server config that the gates need: queues
// and priorities from the config, and a short delayed-task check so that
// requeued tasks come back on time. Config changes to queues need a restart.
func (s *Scheduler) AsynqConfig() asynq.Config {
	cfg := s.Config()
	queues := map[string]int{}
	for name, q := range cfg.Queues {
		queues[name] = q.Priority
	}
	if len(queues) == 0 {
		queues["default"] = 1
	}
	return asynq.Config{
		Concurrency:              cfg.Worker.Concurrency,
		Queues:                   queues,
		DelayedTaskCheckInterval: delayedTaskCheck,
		TaskCheckInterval:        taskCheck,
		Logger:                   asynqLogger{s.log},
		// Neither waiting nor the death of the worker that ran a task is the
		// task's failure: it is not counted, and it comes back soon.
		IsFailure: func(err error) bool {
			return !errors.Is(err, errWaitInRedis) && !errors.Is(err, asynq.ErrLeaseExpired)
		},
		RetryDelayFunc: func(n int, err error, t *asynq.Task) time.Duration {
			if errors.Is(err, errWaitInRedis) || errors.Is(err, asynq.ErrLeaseExpired) {
				return redisRetry
			}
			return asynq.DefaultRetryDelayFunc(n, err, t)
		},
	}
}

// errWaitInRedis is returned when a task that must wait could not be
// requeued before its context ended (Redis failed for that long): asynq then
// retries it without counting a failure, if it has a retry left.
var errWaitInRedis = errors.New("jobs: task must wait and could not be requeued")

// Run keeps the Scheduler's view of the fleet fresh until ctx ends: the
// offset of Redis's clock from ours, the number of live workers (for the
// local policy), the quotas an upstream blocked; and adds this worker's
// completions to the queues' rates (RecentRate).
func (s *Scheduler) Run(ctx context.Context) {
	go s.listenForBlocks(ctx)
	tick := time.NewTicker(5 * time.Second)
	defer tick.Stop()
	for i := 0; ; i++ {
		if i%2 == 0 {
			s.measureClock(ctx)
			if servers, err := s.inspector.Servers(); err == nil && len(servers) > 0 {
				s.workers.Store(int64(len(servers)))
			}
		}
		s.rescueOrphans(ctx)
		if err := s.done.flush(ctx, s.rdb); err != nil && ctx.Err() == nil {
			s.log.Warn("cannot record the queues' rates", "err", err)
		}
		select {
		case <-ctx.Done():
			s.done.flush(context.WithoutCancel(ctx), s.rdb)
			return
		case <-tick.C:
		}
	}
}

// rescueOrphans puts back the tasks that asynq archived only because the
// worker running them died and they had no retry left (MaxRetry 0): sluice
// runs every task at least once. One worker of the fleet looks, every few
// seconds, at the newest 200 archived tasks of each queue (a crash orphans
// at most the tasks its worker was running).
func (s *Scheduler) rescueOrphans(ctx context.Context) {
	claim := throttle.Key("sluice:rescue:", "orphans")
	if ok, err := s.rdb.SetNX(ctx, claim, s.worker, 4*time.Second).Result(); err != nil || !ok {
		return
	}
	const page = 100
	for queue := range s.Config().Queues {
		info, err := s.inspector.GetQueueInfo(queue)
		if err != nil || info.Archived == 0 {
			continue
		}
		// Archived tasks are listed oldest first: look at the last two pages.
		last := (info.Archived-1)/page + 1
		for p := max(1, last-1); p <= last; p++ {
			tasks, err := s.inspector.ListArchivedTasks(queue, asynq.PageSize(page), asynq.Page(p))
			if err != nil {
				break
			}
			for _, t := range tasks {
				if t.LastErr == asynq.ErrLeaseExpired.Error() {
					if err := s.inspector.RunTask(queue, t.ID); err == nil {
						s.log.Info("a task archived when its worker died runs again", "queue", queue, "id", t.ID)
					}
				}
			}
		}
	}
}

// listenForBlocks keeps s.blocked up to date from blockChannel until ctx
// ends; go-redis resubscribes by itself after a reconnect.
func (s *Scheduler) listenForBlocks(ctx context.Context) {
	sub := s.rdb.Subscribe(ctx, blockChannel)
	defer sub.Close()
	for {
		msg, err := sub.ReceiveMessage(ctx)
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			time.Sleep(redisRetry)
			continue
		}
		quota, us, ok := strings.Cut(msg.Payload, " ")
		d, err := strconv.ParseInt(us, 10, 64)
		if !ok || err != nil {
			continue
		}
		s.block(quota, time.Now().Add(time.Duration(d)*time.Microsecond))
	}
}

// block notes that quota may not be drawn on before until.
func (s *Scheduler) block(quota string, until time.Time) {
	for {
		old, loaded := s.blocked.LoadOrStore(quota, until)
		if !loaded || !until.After(old.(time.Time)) || s.blocked.CompareAndSwap(quota, old, until) {
			return
		}
	}
}

// blockedUntil is the latest block on the task type's quotas that this
// worker knows of, or the zero Time.
func (s *Scheduler) blockedUntil(gs *gateSet, typ string) time.Time {
	var until time.Time
	for _, g := range gs.quotasOf(typ) {
		if v, ok := s.blocked.Load(g.key); ok {
			until = later(until, v.(time.Time))
		}
	}
	return until
}

func (s *Scheduler) measureClock(ctx context.Context) {
	before := time.Now()
	redisNow, err := s.rdb.Time(ctx).Result()
	if err != nil {
		return
	}
	rtt := time.Since(before)
	s.offset.Store(int64(redisNow.Sub(before.Add(rtt / 2))))
}

// local returns the instant t of Redis's clock on ours.
func (s *Scheduler) local(t time.Time) time.Time {
	return t.Add(-time.Duration(s.offset.Load()))
}

// Middleware is the asynq middleware that gates every task.
func (s *Scheduler) Middleware(next asynq.Handler) asynq.Handler {
	return asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) error {
		return s.process(ctx, t, next)
	})
}

func (s *Scheduler) process(ctx context.Context, t *asynq.Task, next asynq.Handler) error {
	gs := s.gates.Load()
	queue, _ := asynq.GetQueueName(ctx)
	cost := gs.cost(t.Type())
	b, err := s.book(ctx, gs, queue, t, cost)
	if err != nil {
		return err
	}
	if b.deferFor > 0 {
		s.metrics.throttled.WithLabelValues(queue, "requeued").Inc()
		return s.requeue(ctx, t, queue, time.Now().Add(b.deferFor), nil)
	}
	if wait := time.Until(b.ready); wait > 0 {
		if !s.hold(ctx, gs, queue, wait) {
			s.metrics.throttled.WithLabelValues(queue, "requeued").Inc()
			return s.requeue(ctx, t, queue, b.ready.Add(-requeueLead), b.turns)
		}
		if err := ctx.Err(); err != nil {
			return err // shutting down: asynq puts the task back
		}
	}
	// A turn booked before an upstream said "not now" is not used until it
	// allows again: the task books a new one then.
	if until := s.blockedUntil(gs, t.Type()); time.Now().Before(until) {
		s.metrics.throttled.WithLabelValues(queue, "requeued").Inc()
		return s.requeue(ctx, t, queue, until, nil)
	}
	release, retryIn, err := s.takeSlots(ctx, gs, queue, t)
	if err != nil {
		return err
	}
	if release == nil {
		s.metrics.throttled.WithLabelValues(queue, "requeued").Inc()
		return s.requeue(ctx, t, queue, time.Now().Add(retryIn), b.turns)
	}
	err = next.ProcessTask(ctx, t)
	release()
	result := "ok"
	if err != nil {
		result = "error"
	}
	s.metrics.completed.WithLabelValues(queue, gs.typeLabel(t.Type()), result).Inc()
	s.done.add(queue)
	var busy *UpstreamBusyError
	if errors.As(err, &busy) {
		return s.upstreamBusy(ctx, gs, queue, t, busy)
	}
	return err
}

// hold waits in this worker for wait, if the queue may hold one more of
// this worker's slots; it reports false when the task should rather go
// back to Redis. A turn closer than requeueLead is always waited for: going
// to Redis and back would take longer.
func (s *Scheduler) hold(ctx context.Context, gs *gateSet, queue string, wait time.Duration) bool {
	if wait > gs.cfg.Worker.HoldMax {
		return false
	}
	v, _ := s.holding.LoadOrStore(queue, new(atomic.Int64))
	holding := v.(*atomic.Int64)
	// A slow queue may hold at most half the slots, so that it cannot
	// starve the others on the same workers.
	limit := int64(max(1, gs.cfg.Worker.Concurrency/2))
	if holding.Add(1) > limit && wait > requeueLead {
		holding.Add(-1)
		return false
	}
	defer holding.Add(-1)
	s.metrics.throttled.WithLabelValues(queue, "held").Inc()
	s.metrics.waited.WithLabelValues(queue).Add(wait.Seconds())
	timer := time.NewTimer(wait)
	defer timer.Stop()
	select {
	case <-ctx.Done():
	case <-timer.C:
	}
	return true
}

// requeue sends a copy of the task back to Redis, scheduled for at and
// carrying its turns, and revokes this one: asynq then deletes it without
// counting a failure or a retry, whatever its MaxRetry.
//
// While Redis cannot take the copy (restarting, loading its data, failing
// over), requeue tries again, backing off to once a second, for as long as
// the task's context lasts: the task is in no one else's hands meanwhile,
// and an error would cost it a retry; asynq archives a task that errs with
// none left, failure or not. The copy's id is fixed, so an attempt that
// reached Redis unanswered makes the next one a harmless duplicate.
func (s *Scheduler) requeue(ctx context.Context, t *asynq.Task, queue string, at time.Time, turns []heldTurn) error {
	id, _ := asynq.GetTaskID(ctx)
	giveUp := func(err error, attempts int) error {
		s.log.Warn("cannot requeue a task that must wait; asynq will retry it", "queue", queue, "id", id, "attempts", attempts, "err", err)
		return fmt.Errorf("%w: %v", errWaitInRedis, err)
	}
	backoff := 50 * time.Millisecond
	for attempt := 1; ; attempt++ {
		err := s.copyForLater(ctx, t, queue, id, at, turns)
		if err == nil {
			if attempt > 1 {
				s.log.Info("requeued a task that must wait", "queue", queue, "id", id, "attempts", attempt)
			}
			return asynq.RevokeTask
		}
		if errors.Is(err, asynq.ErrTaskNotFound) || errors.Is(err, asynq.ErrQueueNotFound) {
			return giveUp(err, attempt) // Redis answered: no attempt will find it
		}
		if attempt == 1 {
			s.log.Warn("cannot requeue a task that must wait; trying again", "queue", queue, "id", id, "err", err)
		}
		select {
		case <-ctx.Done():
			return giveUp(err, attempt)
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, time.Second)
	}
}

// copyForLater enqueues the copy of task id that requeue sends back.
func (s *Scheduler) copyForLater(ctx context.Context, t *asynq.Task, queue, id string, at time.Time, turns []heldTurn) error {
	info, err := s.inspector.GetTaskInfo(queue, id)
	if err != nil {
		return err
	}
	headers := make(map[string]string, len(t.Headers())+3)
	for k, v := range t.Headers() {
		headers[k] = v
	}
	origin := headers[headerOrigin]
	if origin == "" {
		origin = id
	}
	hop, _ := strconv.Atoi(headers[headerHop])
	hop++
	headers[headerOrigin] = origin
	headers[headerHop] = strconv.Itoa(hop)
	delete(headers, headerTurns)
	if len(turns) > 0 {
		headers[headerTurns] = writeTurns(turns)
	}
	opts := []asynq.Option{
		asynq.Queue(queue),
		// A deterministic id: if this task runs twice (a worker died after
		// the copy was made), the second copy is refused as a duplicate.
		asynq.TaskID(origin + "~" + strconv.Itoa(hop)),
		asynq.MaxRetry(max(0, info.MaxRetry-info.Retried)),
		asynq.ProcessAt(at),
	}
	if info.Timeout > 0 {
		opts = append(opts, asynq.Timeout(info.Timeout))
	}
	if !info.Deadline.IsZero() {
		opts = append(opts, asynq.Deadline(info.Deadline))
	}
	if info.Retention > 0 {
		opts = append(opts, asynq.Retention(info.Retention))
	}
	_, err = s.client.EnqueueContext(ctx, asynq.NewTaskWithHeaders(t.Type(), t.Payload(), headers), opts...)
	if errors.Is(err, asynq.ErrTaskIDConflict) {
		return nil // an earlier attempt, or an earlier run of this task, made it
	}
	return err
}

// upstreamBusy blocks every quota of the task's type until the upstream's
// Retry-After has passed, on every worker, and sends the task back to wait
// for it: an API that says "not now" has not failed the task.
func (s *Scheduler) upstreamBusy(ctx context.Context, gs *gateSet, queue string, t *asynq.Task, busy *UpstreamBusyError) error {
	wait := busy.RetryAfter
	if wait <= 0 {
		wait = time.Second // no Retry-After: a short pause, then ask the quotas again
	}
	for _, g := range gs.quotasOf(t.Type()) {
		s.metrics.upstreamBusy.WithLabelValues(g.key).Inc()
		s.block(g.key, time.Now().Add(wait))
		if err := g.remote.Block(ctx, g.key, wait); err != nil {
			s.log.Warn("cannot block a quota after an upstream said no", "quota", g.key, "err", err)
		}
		if err := s.rdb.Publish(ctx, blockChannel, g.key+" "+strconv.FormatInt(wait.Microseconds(), 10)).Err(); err != nil {
			s.log.Warn("cannot tell the fleet of a blocked quota", "quota", g.key, "err", err)
		}
	}
	s.log.Info("upstream busy: quotas blocked", "type", t.Type(), "status", busy.Status, "for", wait)
	return s.requeue(ctx, t, queue, time.Now().Add(wait), nil)
}

// takeSlots takes the task's concurrency slots (its queue's and its
// type's), waiting up to HoldMax for them. It returns the function that
// gives them back, or nil and how soon to try again.
func (s *Scheduler) takeSlots(ctx context.Context, gs *gateSet, queue string, t *asynq.Task) (release func(), retryIn time.Duration, err error) {
	sems := gs.semaphoresOf(queue, t.Type())
	if len(sems) == 0 {
		return func() {}, 0, nil
	}
	id, _ := asynq.GetTaskID(ctx)
	holder := s.worker + ":" + id
	deadline := time.Now().Add(gs.cfg.Worker.HoldMax)
	var taken []slot
	giveBack := func() {
		for _, sl := range taken {
			if err := sl.sem.Release(context.WithoutCancel(ctx), sl.key, holder); err != nil {
				s.log.Warn("cannot release a concurrency slot; its lease will end", "slot", sl.key, "err", err)
			}
		}
	}
	for _, sl := range sems {
		for {
			st, err := sl.sem.Acquire(ctx, sl.key, holder)
			if err != nil {
				// No Redis: run rather than hold the slot forever; the
				// rate gates still apply.
				s.log.Warn("concurrency limit unavailable", "slot", sl.key, "err", err)
				break
			}
			if st.Held {
				taken = append(taken, sl)
				break
			}
			if time.Now().After(deadline) || ctx.Err() != nil {
				giveBack()
				return nil, min(max(st.Free, 50*time.Millisecond), time.Second), nil
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() { s.renew(ctx, taken, holder, stop) })
	return func() {
		close(stop)
		wg.Wait()
		giveBack()
	}, 0, nil
}

type slot struct {
	sem *throttle.Semaphore
	key string
}

func (s *Scheduler) renew(ctx context.Context, taken []slot, holder string, stop <-chan struct{}) {
	tick := time.NewTicker(slotLease / 3)
	defer tick.Stop()
	for {
		select {
		case <-stop:
			return
		case <-tick.C:
			for _, sl := range taken {
				if _, err := sl.sem.Renew(context.WithoutCancel(ctx), sl.key, holder); err != nil {
					s.log.Warn("cannot renew a concurrency lease", "slot", sl.key, "err", err)
				}
			}
		}
	}
}
