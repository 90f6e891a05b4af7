package jobs

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
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
	// delayedTaskCheck is how often asynq moves due scheduled and retried
	// tasks to pending. A task waiting in Redis for its turn is moved on
	// time by the waker (wake.go); asynq's own move is its fallback, a
	// second after it is due, and a producer's scheduled task's. Asynq's
	// default of 5s would make those late; each check costs 4 commands.
	delayedTaskCheck = time.Second
	// taskCheck is how long an idle asynq worker sleeps between looks at
	// empty queues: between half of it and one and a half times it.
	taskCheck = 100 * time.Millisecond
	// requeueLead schedules a requeued task this long before its turn: long
	// enough for the waker to make it pending (it takes tasks up to
	// wakeEvery early) and for a worker that was idle to pick it up, with
	// room for a loaded machine; that worker then waits the rest of the way.
	requeueLead = taskCheck*3/2 + 150*time.Millisecond
	// alwaysHold: a task whose turn is this close waits for it in the
	// worker. Going to Redis and back would take longer, and a task back
	// from Redis comes up to wakeEvery early.
	alwaysHold = requeueLead + wakeEvery
	// slotLease is the lease of a concurrency slot; a running task renews it
	// every third of it (see slots.go).
	slotLease = 30 * time.Second
	// redisRetry is how soon a task whose gates Redis could not decide
	// (policy deny) asks again.
	redisRetry = time.Second
)

// Scheduler puts every task through its gates before its handler runs: the
// drain gate of its queue, the quota gates of its type (each a rate limit
// on Redis, shared by the fleet), then the concurrency limits of its queue
// and type. A task that must wait gets one turn on all its rate gates at
// once (booking.go), waits for it in the worker when it is near (Config.Worker
// HoldMax), or goes back to Redis scheduled for it and passes the gates
// without asking again when it comes back (waiting.go). It is never failed,
// retried or archived for having to wait. Run keeps the Scheduler's view of
// the fleet fresh (fleet.go); concurrency slots are in slots.go.
//
// Use Middleware on the asynq.ServeMux, AsynqConfig for the asynq.Server,
// Run in the background, and Apply to change the config live; Close once
// Run has returned (its services use the Scheduler's connections).
type Scheduler struct {
	rdb       redis.UniversalClient
	client    *asynq.Client
	inspector *asynq.Inspector
	queues    redis.UniversalClient // asynq's Redis, for what its API cannot do (see ready)
	metrics   *Metrics
	log       *slog.Logger
	worker    string // this process, for concurrency leases
	clock     schedClock
	slotLease time.Duration // slotLease; shorter in tests

	gates   atomic.Pointer[gateSet]
	running chan struct{} // a token per handler that may run at once (worker.concurrency)
	*booker               // a task's turns on its gates (booking.go)

	// The fleet's housekeeping, one service each, run by Run.
	fleet   *fleetSize     // live workers in the fleet, for the local policy
	board   *blockBoard    // quotas an upstream blocked
	waker   *waker         // tasks that wait in Redis, brought back when due
	parker  *parker        // backlogs booked and moved to wait in Redis in batches (park.go)
	parks   bool           // the limits and the queues are on one server: parker parks
	rescuer *orphanRescue  // tasks orphaned by a worker's death
	rates   *rateRecorder  // completions not yet added to the fleet's rate buckets
	limits  *limitsWatch   // the runtime limits set live (runtimelimits.go)
	adapt   *adaptiveRates // the adaptive quotas' learned rates (adapt.go)
	shares  *shareKeeper   // the sharded queues' shares of their drains (shards.go)
	changes changeWork     // what config changes leave to do, awaited by Run

	// The config in force is file with runtime merged onto it; applying
	// holds applyMu, so that a file's change and a runtime one do not
	// cross.
	applyMu    sync.Mutex
	file       Config
	runtime    []RuntimeLimit
	runtimeSig string // runtimeSignature of runtime when it was put in force
	// pins is runtime, for adapt's reads outside applyMu.
	pins atomic.Pointer[[]RuntimeLimit]
	// busy is which shards of each sharded queue have tasks, as the
	// fleet last said (shards.go); nil: equal shares.
	busy map[string][]bool
}

// NewScheduler returns a Scheduler for cfg. rdb is where the limits live;
// asynqRedis is where the queues are (the same server, as asynq wants it).
func NewScheduler(rdb redis.UniversalClient, asynqRedis asynq.RedisConnOpt, cfg Config, m *Metrics, log *slog.Logger, opts ...Option) (*Scheduler, error) {
	queues := asynqRedis.MakeRedisClient().(redis.UniversalClient)
	s := &Scheduler{
		rdb:       rdb,
		client:    asynq.NewClient(asynqRedis),
		inspector: asynq.NewInspector(asynqRedis),
		queues:    queues,
		metrics:   m,
		log:       log,
		worker:    asynqHost() + ":" + strconv.Itoa(os.Getpid()),
		clock:     schedClock{Clock: throttle.SystemClock{}},
		slotLease: slotLease,
	}
	s.fleet = newFleetSize(queues, func() []string { return slices.Sorted(maps.Keys(servedQueues(s.Config()))) })
	for _, opt := range opts {
		opt(s)
	}
	s.booker = newBooker(rdb, m, log, s.clock)
	deps := fleetDeps{rdb: rdb, queues: queues, clock: s.clock, log: log, worker: s.worker, gates: s.gates.Load}
	s.board = newBlockBoard(deps)
	s.waker = newWaker(deps, m)
	s.parker = newParker(deps, s.booker)
	s.parks = oneServer(rdb, queues)
	s.booker.handsOver = s.parks
	s.waker.moves = s.parks
	s.rescuer = &orphanRescue{fleetDeps: deps, inspector: s.inspector}
	s.rates = &rateRecorder{fleetDeps: deps}
	s.limits = newLimitsWatch(deps, s.applyRuntime)
	s.board.subscribed, s.board.onLimits = s.limits.poke, s.limits.poke
	s.adapt = newAdaptiveRates(deps, m)
	s.adapt.pinned = s.pinned
	s.board.onAdapted = s.adapt.poke
	s.shares = newShareKeeper(deps, s.applyShares)
	s.board.onShares = s.shares.poke
	s.board.onResigned = s.waker.resigned
	cfg = cfg.Defaults()
	if errs := cfg.Validate(); len(errs) > 0 {
		return nil, fmt.Errorf("jobs: config refused: %w", errors.Join(errs...))
	}
	s.file = cfg
	// A worker that starts after a runtime limit was set books by it from
	// its first task; if Redis does not answer now, the file's limits are
	// in force until the watch reads them.
	ctx, cancel := context.WithTimeout(context.Background(), runtimeFirstRead)
	if rl, err := LoadRuntimeLimits(ctx, rdb); err != nil {
		log.Warn("cannot read the runtime limits; the file's are in force until they are read", "err", err)
	} else {
		s.setRuntime(rl)
		s.countRuntime()
	}
	// Likewise the adaptive quotas' learned rates: a worker that starts
	// later books by the fleet's from its first task.
	s.adapt.report(ctx, cfg)
	cfg = s.merged(cfg)
	cancel()
	s.adapt.changed = s.applyAdaptive
	gs, err := s.newGateSet(cfg)
	if err != nil {
		return nil, err
	}
	s.gates.Store(gs)
	s.running = make(chan struct{}, cfg.Worker.Concurrency)
	return s, nil
}

// runtimeFirstRead bounds NewScheduler's read of the runtime limits.
const runtimeFirstRead = 2 * time.Second

// merged is file, a config file's checked config, with the runtime limits
// in force now merged onto it; if they make it one that Validate refuses
// (the file changed under them), file alone, and the problem is logged.
// applyMu is held, or s is new.
func (s *Scheduler) merged(file Config) Config {
	cfg := file.WithRuntimeLimits(s.runtime, s.clock.Now()).Defaults()
	if errs := cfg.Validate(); len(errs) > 0 {
		s.log.Error("the runtime limits do not fit the config file; the file's limits are in force until they are reset", "err", errors.Join(errs...))
		cfg = file
	}
	cfg.Quotas = maps.Clone(cfg.Quotas)
	return mergeLearned(cfg, s.adapt.learned(), s.pinned)
}

// setRuntime makes rl the runtime limits in force; applyMu is held, or s
// is new.
func (s *Scheduler) setRuntime(rl []RuntimeLimit) {
	s.runtime, s.runtimeSig = rl, s.runtimeSignature(rl)
	s.pins.Store(&rl)
}

// pinned reports whether a runtime limit in force sets quota's own limit
// now: an adaptive quota's learned rate then waits.
func (s *Scheduler) pinned(quota string) bool {
	rl := s.pins.Load()
	return rl != nil && pinnedBy(*rl, quota, s.clock.Now())
}

// applyAdaptive puts the config in force again with the adaptive quotas'
// learned limits: the gates whose limit changed take over what their
// predecessors counted, and the tasks held here book again; tasks waiting
// in Redis are not brought forward (a learned rate moves often): each
// books again at the new rate when it comes back for its old turn.
func (s *Scheduler) applyAdaptive() {
	s.applyMu.Lock()
	defer s.applyMu.Unlock()
	if err := s.putInForce(s.merged(s.file), false); err != nil {
		s.log.Error("cannot put an adaptive quota's learned rate in force; the limits in force stay", "err", err)
	}
}

// applyShares puts in force the sharded queues' shares of their drains
// that busy gives: tasks waiting for turns booked at a shard's old rate
// book again.
func (s *Scheduler) applyShares(busy map[string][]bool) {
	s.applyMu.Lock()
	defer s.applyMu.Unlock()
	s.busy = busy
	if err := s.putInForce(s.merged(s.file), true); err != nil {
		s.log.Error("cannot put a sharded queue's shares in force; the shares in force stay", "err", err)
	}
}

func (s *Scheduler) newGateSet(cfg Config) (*gateSet, error) {
	o := gateOptions{workers: s.fleet.shares, lease: s.slotLease, evaluations: s.metrics.evaluations, previous: s.gates.Load(),
		adapt: s.adapt, pinned: s.pinned, busy: s.busy}
	if s.clock.injected {
		o.clock = s.clock.Clock
	}
	gs, err := newGateSet(s.rdb, cfg, o)
	if err == nil {
		s.metrics.showGates(gs)
	}
	return gs, err
}

// Close releases the Scheduler's connections.
func (s *Scheduler) Close() error {
	s.gates.Load().close()
	return errors.Join(s.client.Close(), s.inspector.Close(), s.queues.Close())
}

// Config returns the config in force, each sharded queue replaced by its
// shards (the queues asynq serves; see shards.go).
func (s *Scheduler) Config() Config { return s.gates.Load().cfg }

// ErrRestartNeeded is wrapped by Apply's error for a change that a running
// worker cannot make: asynq fixes its queues and slots when it starts.
var ErrRestartNeeded = errors.New("jobs: the change needs a restart")

// Apply puts cfg in force for every task that starts from now on; tasks
// already past their gates keep their turns. A cfg with problems, or one
// that adds or removes a queue, is refused and the one in force stays.
// Tasks waiting in Redis for turns booked under a changed limit are
// brought forward to book again: on Run's context, and Run returns only
// once that is done; while Run is not running, before Apply returns.
//
// cfg is the config file's: the runtime limits set live (runtimelimits.go)
// stay merged onto it.
func (s *Scheduler) Apply(cfg Config) error {
	cfg = cfg.Defaults()
	if errs := cfg.Validate(); len(errs) > 0 {
		return fmt.Errorf("jobs: config refused: %w", errors.Join(errs...))
	}
	s.applyMu.Lock()
	defer s.applyMu.Unlock()
	if err := s.putInForce(s.merged(cfg), true); err != nil {
		return err
	}
	s.file = cfg
	s.runtimeSig = s.runtimeSignature(s.runtime)
	return nil
}

// runtimeSignature is what of rl is in force now on the file's gates, as
// one string: changes to other gates (another fleet's, on the same Redis)
// leave it as it is.
func (s *Scheduler) runtimeSignature(rl []RuntimeLimit) string {
	now := s.clock.Now()
	var b strings.Builder
	for _, r := range rl {
		if s.file.limitOf(r.Gate) == nil {
			continue
		}
		b.WriteString(mustJSON(r))
		if r.lapsed(now) {
			b.WriteString(" lapsed")
		}
		b.WriteByte('\n')
	}
	return b.String()
}

// applyRuntime puts the runtime limits rl in force, merged onto the file.
func (s *Scheduler) applyRuntime(rl []RuntimeLimit) {
	s.applyMu.Lock()
	defer s.applyMu.Unlock()
	// The fleet is told of every change, any gate's, and reads them all
	// again on each subscription: a gate set built anew for the same
	// limits would drop the turns its pools had leased.
	sig := s.runtimeSignature(rl)
	if sig == s.runtimeSig {
		return
	}
	s.setRuntime(rl)
	if err := s.putInForce(s.merged(s.file), true); err != nil {
		s.log.Error("cannot put the runtime limits in force; the limits in force stay", "err", err)
		return
	}
	s.countRuntime()
}

// countRuntime sets sluice_runtime_limits from the runtime limits in force
// on the file's gates (the labels are the config's, not Redis's).
func (s *Scheduler) countRuntime() {
	s.metrics.runtimeLimits.Reset()
	now := s.clock.Now()
	for _, r := range s.runtime {
		if r.InForce(now) && s.file.limitOf(r.Gate) != nil {
			s.metrics.runtimeLimits.WithLabelValues(r.Gate.String()).Inc()
		}
	}
}

// putInForce puts cfg, checked, in force; applyMu is held. With rebook,
// tasks waiting in Redis for turns of changed gates are brought forward to
// book again.
func (s *Scheduler) putInForce(cfg Config, rebook bool) error {
	old := s.gates.Load()
	// The queues as asynq serves them: a sharded queue's shards.
	if was, now := slices.Sorted(maps.Keys(old.cfg.Queues)), slices.Sorted(maps.Keys(cfg.sharded(nil).Queues)); !slices.Equal(was, now) {
		return fmt.Errorf("%w: the queues would change from %v to %v; the config in force stays", ErrRestartNeeded, was, now)
	}
	gs, err := s.newGateSet(cfg)
	if err != nil {
		return err
	}
	if old := s.gates.Swap(gs); old != nil {
		old.close()
		if stale := changedTags(old, gs); len(stale) > 0 {
			close(old.replaced) // tasks waiting here book again
			if rebook {
				s.changes.do(func(ctx context.Context) { s.waker.rebook(ctx, gs, stale) })
			}
		}
	}
	return nil
}

// AsynqConfig returns the asynq.Server config that the gates need: queues
// and priorities from the config, and a delayed-task check of a second.
// Config changes to queues need a restart.
func (s *Scheduler) AsynqConfig() asynq.Config {
	cfg := s.Config()
	queues := servedQueues(cfg)
	return asynq.Config{
		// asynq runs a handler per slot; sluice's middleware lets only
		// Concurrency of them run theirs at once and the others wait for
		// their turn (see hold).
		Concurrency:              cfg.Worker.Concurrency + cfg.Worker.Waiting,
		Queues:                   queues,
		DelayedTaskCheckInterval: delayedTaskCheck,
		TaskCheckInterval:        taskCheck,
		Logger:                   asynqLogger{s.log},
		// Waiting is not the task's failure: it is not counted, and it
		// comes back soon. The death of the worker that ran it is: a task
		// that crashes its worker must not crash the fleet for ever (see
		// rescue for the one death a task without retries is forgiven).
		IsFailure: func(err error) bool {
			var wait *waitError
			return !errors.As(err, &wait) && !errors.Is(err, errWaitInRedis)
		},
		RetryDelayFunc: func(n int, err error, t *asynq.Task) time.Duration {
			var wait *waitError
			switch {
			case errors.As(err, &wait):
				// asynq's own schedule is the fallback: the wake set brings
				// the task back on time (see wake.go).
				return wait.wait + wakeLatest
			case errors.Is(err, errWaitInRedis) || errors.Is(err, asynq.ErrLeaseExpired):
				return redisRetry
			}
			return asynq.DefaultRetryDelayFunc(n, err, t)
		},
	}
}

// servedQueues is the queues an asynq server for cfg serves, with their
// priorities (asynq's "default" where cfg names none).
func servedQueues(cfg Config) map[string]int {
	queues := map[string]int{}
	for name, q := range cfg.Queues {
		queues[name] = q.Priority
	}
	if len(queues) == 0 {
		queues["default"] = 1
	}
	return queues
}

// Middleware is the asynq middleware that gates every task.
func (s *Scheduler) Middleware(next asynq.Handler) asynq.Handler {
	return asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) error {
		return s.process(ctx, t, next)
	})
}

// process takes a task along its path: its turn on the rate gates (book,
// whose outcome says what comes next), the wait for it (hold here, or
// requeue to Redis), an upstream's block, the concurrency slots, then its
// handler. The task is read once (taskRef). What the task took on the way
// is given back by one defer, whatever the handler does: return, panic
// (asynq recovers it above this middleware and fails the task with it) or
// runtime.Goexit.
func (s *Scheduler) process(ctx context.Context, t *asynq.Task, next asynq.Handler) error {
	queue, _ := asynq.GetQueueName(ctx)
	id, _ := asynq.GetTaskID(ctx)
	task := refOf(ctx, queue, id, t)
	tk := &taken{s: s, ctx: ctx, queue: queue}
	defer tk.giveBack()
	var gs *gateSet
	letOut := false
booking:
	for {
		gs = s.gates.Load()
		o, err := s.book(ctx, gs, task, letOut)
		if err != nil {
			return err
		}
		switch o := o.(type) {
		case runNow:
			tk.turns = o.turns
			break booking
		case turnAhead:
			tk.turns = o.turns
			wait := o.ready.Sub(s.clock.Now())
			if wait <= 0 {
				break booking
			}
			switch s.hold(ctx, gs, task, wait, o.turns.claims) {
			case held:
				break booking
			case toRedis:
				// Its turns stay kept under its booking ID: back for them
				// just before they come, it gets them.
				tk.keepTurns()
				s.parkBehind(task)
				return s.waitInRedis(ctx, task, dueBack{d: wait - requeueLead, at: o.at.Add(-requeueLead)})
			case limitsChanged:
				s.giveBackStale(ctx, gs, tk) // booked at the old rate: book at the new one
			case keyRateChanged:
				// Booked at a key value's old learned rate: at the new one,
				// whose state took over none of the turns booked ahead.
				tk.giveBackTurns()
			}
		case notedIn:
			s.parkBehind(task)
			return s.waitNoted(queue, o.d)
		case askAgainIn:
			s.parkBehind(task)
			return s.waitInRedis(ctx, task, o)
		case waitInLine:
			if letOut, err = s.waitInLine(ctx, task, o.spot); !letOut {
				return err
			}
			// Let out of its line, it books.
		case toParker:
			return s.handToParker(ctx, task)
		default:
			panic(fmt.Sprintf("jobs: process has no case for outcome %T", o)) // a new outcome must have one
		}
	}
	// Its turns have come: from here on they are given back unless its
	// handler starts.
	if err := ctx.Err(); err != nil {
		return err // shutting down: asynq puts the task back; its turns go to others
	}
	// A turn booked before an upstream said "not now" is not used until it
	// allows again: the task books a new one then.
	if until := s.blockedUntil(gs, queue, id, t); s.clock.Now().Before(until) {
		return s.waitInRedis(ctx, task, askAgainIn{until.Sub(s.clock.Now())})
	}
	slots, retryIn := s.takeSlots(ctx, gs, task)
	if slots == nil {
		return s.waitInRedis(ctx, task, askAgainIn{retryIn})
	}
	tk.slots = slots
	select {
	case s.running <- struct{}{}:
		tk.running = true
	case <-ctx.Done():
		return ctx.Err()
	}
	tk.start(gs.typeLabel(t.Type()))
	s.countAdmitted(gs, queue, t.Type())
	quotas := gs.routeOf(queue, t.Type()).quotas
	var vars *taskVars // only for a keyed adaptive quota: most tasks have none
	handlerCtx, reporter := s.adapt.reporterFor(slots.ctx, quotas, func(g *gate) string {
		if vars == nil {
			vars = varsOf(queue, id, t)
		}
		key, err := g.expr.eval(vars) // evaluated and its failure counted when the task booked
		if err != nil {
			return DefaultKey
		}
		return key
	})
	err := next.ProcessTask(handlerCtx, t)
	tk.returned = true
	if tk.giveBack() && err != nil {
		// Stopped for losing a concurrency slot: not a failure of the
		// task, which waits in Redis and runs again once it has its slots.
		return s.waitInRedis(ctx, task, askAgainIn{0})
	}
	var busy *UpstreamBusyError
	result := "ok"
	switch {
	case errors.As(err, &busy):
		result = "upstream_busy" // the upstream said "not now": not the task's failure
	case err != nil:
		result = "error"
	}
	tk.complete(result)
	reporter.returned(err, busy)
	if busy != nil {
		return s.upstreamBusy(ctx, gs, task, busy)
	}
	return err
}

// handToParker sends task back to Redis unbooked, handed to the parker
// (toParker): its id (its copy's, with no retry left) goes on the queue's
// handed list, which the parker books before what its queue still has
// pending (those were queued after it). asynq brings it back by itself
// parkHold later should no parker book it; one that does notes it in the
// wake set for its turn.
func (s *Scheduler) handToParker(ctx context.Context, task taskRef) error {
	id, done := task.id, error(&waitError{wait: parkHold})
	if task.exhausted {
		// With no retry left it goes back as a copy, as for any wait
		// (requeue): the copy, unbooked, is the one handed over.
		copyID, _, err := s.copyForLater(ctx, task, askAgainIn{parkHold})
		if err != nil {
			return s.waitInRedis(ctx, task, askAgainIn{redisRetry}) // its requeue tries again
		}
		id, done = copyID, asynq.RevokeTask
	}
	key := handedKey(task.queue)
	pipe := s.queues.Pipeline()
	pipe.RPush(ctx, key, id)
	pipe.Expire(ctx, key, handedLife)
	if _, err := pipe.Exec(ctx); err != nil {
		s.booker.logRedisError(task.queue, err)
		if task.exhausted {
			return done // the copy is back by itself after parkHold
		}
		// Not handed: it asks again soon, as a task Redis failed.
		return s.waitInRedis(ctx, task, askAgainIn{redisRetry})
	}
	s.parker.askHanded(task.queue)
	s.metrics.throttled.WithLabelValues(task.queue, "requeued").Inc()
	return done
}

// parkBehind has the tasks queued behind a fresh task that goes back to
// Redis to wait parked, rather than each taken and sent back (park.go).
func (s *Scheduler) parkBehind(task taskRef) {
	if task.fresh && s.parks {
		s.parker.ask(task.queue)
	}
}

// countAdmitted counts a task whose handler starts as admitted by each
// rate gate on its way: its drain, its quotas and its queue's fair share.
func (s *Scheduler) countAdmitted(gs *gateSet, queue, typ string) {
	for _, g := range gs.routeOf(queue, typ).gates {
		s.metrics.admitted.WithLabelValues(g.name).Inc()
	}
	if f := gs.fair[queue]; f != nil {
		s.metrics.admitted.WithLabelValues(f.name).Inc()
	}
}

// taken is what a task has taken on its way to its handler: turns on its
// rate gates, concurrency slots, a run token. giveBack, deferred by
// process, gives back whatever is still held however process ends.
type taken struct {
	s     *Scheduler
	ctx   context.Context
	queue string

	turns   bookedTurns // turns not used: given back unless the handler started
	slots   *slotHold   // concurrency slots held, or nil
	running bool        // it holds a run token (s.running)

	typeLabel string // the task's type in the metrics, once its handler started
	started   bool   // its handler was called: its turns are used
	returned  bool   // its handler returned (else it panicked or called runtime.Goexit)
}

// start notes that the task's handler is about to run: its turns are used.
func (tk *taken) start(typeLabel string) {
	tk.started, tk.typeLabel, tk.turns = true, typeLabel, bookedTurns{}
}

// keepTurns notes that the task goes back to Redis with its turns, kept
// under its booking ID for when it comes back: they are not given back.
func (tk *taken) keepTurns() { tk.turns = bookedTurns{} }

// giveBackTurns gives back the turns the task holds, if any.
func (tk *taken) giveBackTurns() {
	if len(tk.turns.claims) > 0 {
		tk.s.giveBack(tk.ctx, tk.turns)
		tk.turns = bookedTurns{}
	}
}

// complete counts the handler's end with result.
func (tk *taken) complete(result string) {
	tk.s.metrics.completed.WithLabelValues(tk.queue, tk.typeLabel, result).Inc()
	tk.s.rates.add(tk.queue)
}

// giveBack gives back what the task still holds, once: its slots, its run
// token and its turns. It reports whether the task was stopped for losing
// a slot. A handler that never returned counts as an error.
func (tk *taken) giveBack() (lost bool) {
	if tk.slots != nil {
		lost = tk.slots.release()
		tk.slots = nil
	}
	if tk.running {
		<-tk.s.running
		tk.running = false
	}
	tk.giveBackTurns()
	if tk.started && !tk.returned {
		tk.complete("error")
	}
	return lost
}

// logRedisError logs that the limits' Redis failed, at most once every
// 10 seconds per queue: an outage must not flood the log.
func (b *booker) logRedisError(queue string, err error) {
	if d, _ := b.logGate.AllowN(context.Background(), queue, 1); d.Allowed {
		b.log.Warn("gates cannot reach redis; tasks wait in Redis and ask again (further failures in the next 10s are only counted)", "queue", queue, "err", err)
	}
}
