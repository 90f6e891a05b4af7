package jobs

import (
	"context"
	"strconv"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/lua"
)

// A task that waits in Redis is scheduled in asynq for a second after it is
// due, and noted in its queue's wake set with the µs it is due at. asynq
// schedules in whole seconds: a task scheduled for 12:00:00.900 becomes
// pending just after 12:00:00.000, 900ms early, and a worker would have to
// hold it (taking a slot) or send it round again. Instead one worker of the
// fleet at a time, the queue's waker, takes the tasks due from the wake set
// and moves them to the head of pending (ready: lua/ready.lua; asynq's
// Inspector.RunTask would put them behind the backlog) on time; the others
// only ask now and then whether its lease has lapsed. If no worker does,
// asynq's own forwarder still brings them, a little late, and they book
// again.
const (
	wakeBatch = 100 // tasks one look moves at most
	// wakeEvery: the waker looks this often, and each look takes the tasks
	// due before the next one too: they come back up to wakeEvery early,
	// and wait the rest in the worker (see hold). A look costs a script run
	// and 3 commands (5 as it renews the lease) however many tasks it
	// takes: looking when each task comes would cost that per task.
	wakeEvery = 100 * time.Millisecond
	fairLook  = 20 * time.Millisecond // how often a waker lets tasks out of fair lines
	wakeLease = time.Second           // a waker that dies is replaced this soon
	// wakeWatch: how often the other workers ask whether the waker's
	// lease lapsed (it died). A waker that stops resigns and says so on
	// blockChannel (resignedNotice): the others look at once.
	wakeWatch  = time.Second
	wakeLatest = time.Second // how much later than due asynq brings a task back by itself
	// A task due that asynq still has as running is looked at again
	// wakeAgain later, for up to wakeStillActive after it was due: it is
	// on its way to the retry list.
	wakeAgain       = 20 * time.Millisecond
	wakeStillActive = time.Second
)

var (
	wakeScript  = redis.NewScript(lua.Wake)
	readyScript = redis.NewScript(lua.Ready)
)

// waker brings back the tasks that wait in Redis when they are due: in
// every queue of the config in force whose waker this worker is, it takes
// them from the wake set and moves them to the head of pending (run); it
// is told of tasks noted due sooner than its next look (note).
type waker struct {
	fleetDeps
	metrics *Metrics

	// moves: the queues are on the limits' server, and a take moves the
	// tasks it takes to pending in the same script run (else ready does).
	moves    bool
	wakerOf  sync.Map      // queue -> time.Time: this worker's next look at the queue's wake set, while it is its waker
	lookNow  chan struct{} // a task was noted due before the next look
	watchNow chan struct{} // a waker resigned: the queues this worker watches are looked at now
}

func newWaker(deps fleetDeps, m *Metrics) *waker {
	return &waker{fleetDeps: deps, metrics: m, lookNow: make(chan struct{}, 1), watchNow: make(chan struct{}, 1)}
}

// resignedNotice is published on blockChannel by a worker that stopped
// being a queue's waker: the others look at once, rather than at their
// next watch, up to wakeWatch later, when tasks due meanwhile would come
// back later than their turns' lead.
const resignedNotice = "resigned"

// resigned tells this worker that a waker resigned (resignedNotice).
func (w *waker) resigned() {
	select {
	case w.watchNow <- struct{}{}:
	default:
	}
}

// note notes that task id of queue is due back in wait (at, on the
// limiters' clock, if not zero: then the script needs no TIME), and tells
// the waker if it would otherwise look too late.
func (w *waker) note(ctx context.Context, queue, id string, wait time.Duration, at time.Time) error {
	due := strconv.FormatInt(wait.Microseconds(), 10)
	if !at.IsZero() {
		due = "@" + strconv.FormatInt(at.UnixMicro(), 10)
	}
	err := wakeScript.Run(ctx, w.rdb, wakeKeys(queue), w.clock.scriptNow(), "note", id, due).Err()
	if err == nil {
		w.lookSooner(queue, wait)
	}
	return err
}

// lookSooner tells the waker of a task of queue noted due in wait, if it
// would otherwise look too late for it.
func (w *waker) lookSooner(queue string, wait time.Duration) {
	if next, ok := w.wakerOf.Load(queue); ok && w.clock.Now().Add(wait).Before(next.(time.Time)) {
		select {
		case w.lookNow <- struct{}{}:
		default:
		}
	}
}

// run moves the tasks due back to pending, in every queue whose waker
// this worker is, until ctx ends; then it resigns. Each queue is looked at
// on its own schedule: every wakeEvery (or sooner, see wakeQueue) where
// this worker is the waker, every wakeWatch where another is.
func (w *waker) run(ctx context.Context) {
	looks := map[string]*wakeLook{}
	for {
		queues := w.gates().cfg.Queues
		for queue := range looks {
			if _, ok := queues[queue]; !ok {
				delete(looks, queue)
				w.wakerOf.Delete(queue)
			}
		}
		soonest := w.clock.Now().Add(wakeLease)
		for queue := range queues {
			l := looks[queue]
			if l == nil {
				l = &wakeLook{}
				looks[queue] = l
			}
			if !w.clock.Now().Before(l.next) {
				d := w.look(ctx, queue, l)
				l.next = w.clock.Now().Add(d)
				if l.held {
					w.wakerOf.Store(queue, l.next)
				} else {
					w.wakerOf.Delete(queue)
				}
			}
			soonest = earliest(soonest, l.next)
		}
		select {
		case <-ctx.Done():
			w.resign(ctx)
			return
		case <-w.lookNow:
			for _, l := range looks {
				if l.held {
					l.next = time.Time{}
				}
			}
		case <-w.watchNow:
			for _, l := range looks {
				if !l.held {
					l.next = time.Time{}
				}
			}
		case <-w.clock.After(max(soonest.Sub(w.clock.Now()), 0)):
		}
	}
}

// resign gives up this worker's leases as a waker, and tells the others
// if it held one, as run ends with ctx.
func (w *waker) resign(ctx context.Context) {
	stop, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
	defer cancel()
	held := false
	for queue := range w.gates().cfg.Queues {
		n, _ := wakeScript.Run(stop, w.rdb, wakeKeys(queue), w.clock.scriptNow(), "resign", w.worker).Int()
		held = held || n == 1
	}
	if held {
		_ = w.rdb.Publish(stop, blockChannel, resignedNotice).Err()
	}
}

func earliest(a, b time.Time) time.Time {
	if b.Before(a) {
		return b
	}
	return a
}

// wakeLook is what this worker knows of one queue's waker between looks.
type wakeLook struct {
	next  time.Time // when to look again
	held  bool      // this worker is the waker
	busy  bool      // while held: the last take moved tasks, or fair lines wait
	renew time.Time // while held: when to renew the lease (at half its life)
	// ahead is how far Redis's clock is ahead of ours (µs), from the now
	// of the last take that read it (TIME): the takes between two
	// renewals send their now reckoned from it instead. Zero: not read
	// yet.
	ahead int64
}

// look looks at queue's wake set if this worker is its waker (or may
// become it) and returns how soon to look again. Most looks find nothing
// to do, in a fleet that idles or a queue whose tasks wait far ahead: they
// cost a plain command or two, not a script run. The waker runs the take
// script only when a task is due within wakeEvery (and the clocks' skew)
// or a fair line waits, and renews its lease with PEXPIRE at half its
// life; the others GET the lease's holder, and try to take it only once it
// has lapsed or the waker resigned.
func (w *waker) look(ctx context.Context, queue string, l *wakeLook) time.Duration {
	if l.held && !l.busy {
		switch idle, err := w.nothingDue(ctx, queue); {
		case err != nil || !idle:
		case w.clock.Now().Before(l.renew):
			return wakeEvery
		default:
			if w.renewLease(ctx, queue) {
				l.renew = w.clock.Now().Add(wakeLease / 2)
				return wakeEvery
			}
		}
	} else if !l.held {
		// The lease may be this worker's own, taken by a take whose reply
		// was lost (a master failing over): then it takes at once, not
		// after the lease has lapsed.
		if holder, err := w.rdb.Get(ctx, wakeKeys(queue)[1]).Result(); err == nil && holder != w.worker {
			return wakeWatch // another worker's lease
		}
	}
	renew := !l.held || !w.clock.Now().Before(l.renew)
	d, held, busy := w.take(ctx, queue, renew, l)
	l.held, l.busy = held, held && busy
	if held && renew {
		l.renew = w.clock.Now().Add(wakeLease / 2)
	}
	return d
}

// wakeSkew is how far a worker's clock may be behind Redis's before the
// waker's plain looks (nothingDue) see a task due a little late: by at
// most the difference beyond wakeSkew.
const wakeSkew = 250 * time.Millisecond

// nothingDue reports whether queue's wake set has no task due within
// wakeEvery (on this worker's clock, with wakeSkew to spare) and, for a
// fair queue, no task waits in a line: one trip, two plain commands.
func (w *waker) nothingDue(ctx context.Context, queue string) (bool, error) {
	pipe := w.rdb.Pipeline()
	first := pipe.ZRangeWithScores(ctx, wakeKeys(queue)[0], 0, 0)
	var lined *redis.IntCmd
	if f := w.gates().fair[queue]; f != nil {
		lined = pipe.ZCard(ctx, f.linedKeys())
	}
	if _, err := pipe.Exec(ctx); err != nil {
		return false, err
	}
	if lined != nil && lined.Val() > 0 {
		return false, nil
	}
	due := first.Val()
	horizon := w.clock.Now().Add(wakeEvery + wakeSkew).UnixMicro()
	return len(due) == 0 || due[0].Score > float64(horizon), nil
}

// renewLease extends this worker's lease as queue's waker by wakeLease, if
// it still holds it: false if it does not (it lapsed or Redis lost it),
// and the next look runs the take script. GET and PEXPIRE are two trips,
// not one script: between them the lease, renewed at half its life, has
// half a second left, and should it lapse and pass to another worker in
// between, the PEXPIRE only lengthens the other's lease.
func (w *waker) renewLease(ctx context.Context, queue string) bool {
	key := wakeKeys(queue)[1]
	holder, err := w.rdb.Get(ctx, key).Result()
	if err != nil || holder != w.worker {
		return false
	}
	ok, err := w.rdb.PExpire(ctx, key, wakeLease).Result()
	return err == nil && ok
}

// wakeQueue moves queue's tasks that are due (or nearly) to pending, if
// this worker is its waker, and returns how soon to look again and whether
// it is the waker.
func (w *waker) wakeQueue(ctx context.Context, queue string) (time.Duration, bool) {
	d, held, _ := w.take(ctx, queue, true, &wakeLook{})
	return d, held
}

// take is wakeQueue's look by this worker, the waker as l says: it takes
// the lease if no worker holds it, and renews it if renew; without renew,
// this worker holds the lease, which has life left, and the take reckons
// Redis's clock from l.ahead. It reports too whether it found work: tasks
// due, or waiting in fair lines.
func (w *waker) take(ctx context.Context, queue string, renew bool, l *wakeLook) (d time.Duration, held, busy bool) {
	lease, now := wakeLease.Microseconds(), w.clock.scriptNow()
	if !renew {
		lease = -lease
		if now == "" && l.ahead != 0 {
			now = strconv.FormatInt(w.clock.Now().UnixMicro()+l.ahead, 10)
		}
	}
	reckoned := now != ""
	keys, args := wakeKeys(queue), []any{now, "take", wakeBatch, wakeEvery.Microseconds(), w.worker, lease}
	if f := w.gates().fair[queue]; f != nil {
		more, extra := f.wakeArgs()
		keys, args = append(keys, more...), append(args, extra...)
	}
	moves := w.moves && w.gates().fair[queue] == nil
	if moves {
		prefix := asynqKeys(queue)
		keys = append(keys, prefix+"pending", prefix+"retry", prefix+"scheduled")
		args = append(args, prefix+"t:", w.clock.Now().UnixNano(), wakeAgain.Microseconds(), wakeStillActive.Microseconds())
	}
	sent := w.clock.Now()
	reply, err := wakeScript.Run(ctx, w.rdb, keys, args...).Slice()
	if err != nil || len(reply) == 0 {
		return wakeEvery, false, false
	}
	lines, _ := reply[0].(int64)
	if lines == -2 && len(reply) == 2 {
		// Another worker is the waker: look again when its lease ends, or
		// sooner in case it resigns.
		until, _ := reply[1].(int64)
		return min(time.Duration(until)*time.Microsecond+time.Millisecond, wakeWatch), false, false
	}
	if len(reply) < 2 {
		return wakeEvery, false, false
	}
	if redisNow, _ := reply[1].(int64); !reckoned && !w.clock.injected {
		// From when the take was sent, not answered: a slow trip puts the
		// reckoning ahead of Redis's clock, never behind, and the looks
		// until the next renewal take tasks early (they wait in the
		// worker), never late (a turn used late is lost).
		l.ahead = redisNow - sent.UnixMicro()
	}
	if moves {
		for i := 3; i < len(reply); i += 2 {
			if moved, _ := reply[i].(int64); moved == 1 {
				w.metrics.woken.Inc()
			}
		}
	} else if err := w.ready(ctx, queue, reply[2:]); err != nil {
		w.log.Warn("cannot move tasks due back to their queue; asynq brings them a second late", "queue", queue, "err", err)
	}
	busy = len(reply) > 2 || lines == 1
	switch {
	case (len(reply)-2)/2 >= wakeBatch:
		return 0, true, busy // more may be due
	case lines == 1:
		// Tasks wait in fair lines, on shares, not on time: look again
		// soon.
		return fairLook, true, busy
	}
	return wakeEvery, true, busy
}

// rebook brings forward the tasks waiting in Redis for turns booked under
// a limit that has changed: they were scheduled at the old rate. Back in a
// worker, they book new turns at the new rate. One worker of the fleet does
// it for each change.
func (w *waker) rebook(ctx context.Context, gs *gateSet, stale []string) {
	claim := rebookClaim(stale)
	if ok, err := w.rdb.SetNX(ctx, claim, w.worker, time.Minute).Result(); err != nil || !ok {
		return
	}
	moved := 0
	for queue := range gs.cfg.Queues {
		// Every task that waits in Redis for a turn is in its queue's wake
		// set; a changed quota may be any type's, in any queue.
		n, err := wakeScript.Run(ctx, w.rdb, wakeKeys(queue), w.clock.scriptNow(), "rush").Int()
		if err != nil {
			w.log.Warn("cannot bring forward tasks booked at an old rate", "queue", queue, "err", err)
			continue
		}
		moved += n
	}
	w.log.Info("limits changed: tasks booked at the old rate book again", "gates", stale, "tasks", moved)
}

// ready moves the tasks taken from the wake set (id, µs since due, ...) to
// the head of their queue, in one call: a task back for its turn is taken
// before the queue's backlog. A task that asynq still lists as running was
// noted just before asynq moved it to its retry list: it is looked at again
// in a moment, for up to a second after it was due.
func (w *waker) ready(ctx context.Context, queue string, taken []any) error {
	if len(taken) == 0 {
		return nil
	}
	prefix := asynqKeys(queue)
	args := []any{prefix + "t:", w.clock.Now().UnixNano()}
	for i := 0; i+1 < len(taken); i += 2 {
		args = append(args, taken[i])
	}
	moved, err := readyScript.Run(ctx, w.queues, []string{prefix + "pending", prefix + "retry", prefix + "scheduled"}, args...).Int64Slice()
	if err != nil {
		return err
	}
	for i, result := range moved {
		id, _ := taken[2*i].(string)
		overdue, _ := taken[2*i+1].(int64)
		switch {
		case result == 1:
			w.metrics.woken.Inc()
		case result == 2 && overdue < wakeStillActive.Microseconds():
			_ = w.note(ctx, queue, id, wakeAgain, time.Time{})
		}
		// Otherwise gone (it ran, was deleted), pending already, or
		// archived: nothing to do.
	}
	return nil
}
