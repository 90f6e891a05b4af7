package jobs

import (
	"context"
	"errors"
	"fmt"
	"math"
	"net"
	"strconv"
	"strings"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/throttle"
)

// blockChannel carries "<quota> <µs>" to every worker when an upstream
// said "not now": tasks that already hold a turn on the quota learn of it
// before they call (new turns are kept out by the quota's own block).
const blockChannel = "sluice:blocked"

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
		// Every task that waits in Redis for a turn is in its queue's wake
		// set; a changed quota may be any type's, in any queue.
		n, err := wakeScript.Run(ctx, s.rdb, wakeKeys(queue), s.scriptNow(), "rush").Int()
		if err != nil {
			s.log.Warn("cannot bring forward tasks booked at an old rate", "queue", queue, "err", err)
			continue
		}
		moved += n
	}
	s.log.Info("limits changed: tasks booked at the old rate book again", "gates", stale, "tasks", moved)
}

// Run keeps the Scheduler's view of the fleet fresh until ctx ends: the
// number of live workers (for the local policy, which waits until Run has
// counted them: fleetsize.go), the quotas an upstream
// blocked; brings back the tasks that waited in Redis when they are due
// (wake.go); and adds this worker's completions to the queues' rates
// (RecentRate).
func (s *Scheduler) Run(ctx context.Context) {
	go s.listenForBlocks(ctx, nil)
	go s.wake(ctx)
	go s.fleet.run(ctx)
	tick := time.NewTicker(5 * time.Second)
	defer tick.Stop()
	for {
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

// rescueOrphans runs again the tasks that asynq archived only because the
// worker running them died and they had no retry left (MaxRetry 0): one
// worker death is forgiven (a deploy), a second is not (see rescue). One
// worker of the fleet looks, every few seconds, at the newest 200 archived
// tasks of each queue (a crash orphans at most the tasks its worker was
// running).
func (s *Scheduler) rescueOrphans(ctx context.Context) {
	claim := throttle.Key("sluice:rescue:", "orphans")
	if ok, err := s.rdb.SetNX(ctx, claim, s.worker, 4*time.Second).Result(); err != nil || !ok {
		return
	}
	const page = 100
	for queue := range s.Config().Queues {
		// The size of the archive alone: Inspector.GetQueueInfo would also
		// sample the memory of the queue's tasks, some 30 commands.
		archived, err := s.queues.ZCard(ctx, asynqKeys(queue)+"archived").Result()
		if err != nil || archived == 0 {
			continue
		}
		// Archived tasks are listed oldest first: look at the last two pages.
		last := int((archived-1)/page + 1)
		for p := max(1, last-1); p <= last; p++ {
			tasks, err := s.inspector.ListArchivedTasks(queue, asynq.PageSize(page), asynq.Page(p))
			if err != nil {
				break
			}
			for _, t := range tasks {
				if s.rescue(ctx, queue, t) {
					s.log.Info("a task archived when its worker died runs again", "queue", queue, "id", t.ID)
				}
			}
		}
	}
}

// rescue runs again task t of queue, archived by asynq because its worker
// died and it had no retry left, if it has not been rescued before: a task
// whose runs keep ending in worker deaths (a poison task that crashes its
// worker) stays archived, its last error asynq's "task lease expired", and
// that is logged once. A task with retries spends one per worker death
// (AsynqConfig's IsFailure counts them) and is archived by asynq once they
// are spent; it is not rescued.
func (s *Scheduler) rescue(ctx context.Context, queue string, t *asynq.TaskInfo) bool {
	if t.LastErr != asynq.ErrLeaseExpired.Error() || t.MaxRetry > 0 {
		return false
	}
	key := throttle.Key("sluice:rescued:", queue) + ":" + t.ID
	first, err := s.rdb.SetNX(ctx, key, "rescued", rescueMemory).Result()
	switch {
	case err != nil:
		return false
	case !first:
		// Report it once: the mark says so.
		if was, err := s.rdb.SetArgs(ctx, key, "reported", redis.SetArgs{Get: true, KeepTTL: true}).Result(); err == nil && was == "rescued" {
			s.log.Warn("a task whose runs ended in worker deaths twice stays archived", "queue", queue, "id", t.ID, "type", t.Type)
		}
		return false
	}
	return s.inspector.RunTask(queue, t.ID) == nil
}

// rescueMemory is how long a rescued task is remembered as rescued.
const rescueMemory = 24 * time.Hour

// listenForBlocks keeps s.blocked up to date from blockChannel until ctx
// ends. On any error (a silent connection counts, see blockHealthCheck) it
// subscribes again from scratch: go-redis's own reconnect dials the node it
// had, and on Redis Cluster that node may be dead and its replica in its
// place (measured: 49 s of redialling a dead node, 55 of 300 messages
// received). A ClusterClient reloads the cluster's state first, so that
// the new subscription goes to the channel's current node. Each time it has
// subscribed, it reads back from Redis the blocks in force, which it may
// have missed: messages sent while it was not subscribed are lost; then it
// calls readBack, if not nil.
func (s *Scheduler) listenForBlocks(ctx context.Context, readBack func()) {
	backoff := blockRetryMin
	if readBack == nil {
		readBack = func() {}
	}
	for {
		err := s.takeBlocks(ctx, func() { backoff = blockRetryMin }, readBack)
		if ctx.Err() != nil {
			return
		}
		if d, _ := s.logGate.AllowN(context.Background(), "blocks", 1); d.Allowed {
			s.log.Warn("the subscription to upstream blocks failed; subscribing again (further failures in the next 10s are not logged)", "in", backoff, "err", err)
		}
		if cluster, ok := s.rdb.(*redis.ClusterClient); ok {
			cluster.ReloadState(ctx)
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, blockRetryMax)
	}
}

const (
	// blockRetryMin and blockRetryMax bound the wait before subscribing
	// again: soon, since blocks announced meanwhile are not heard, but not
	// in a busy loop while a cluster fails over (a few seconds).
	blockRetryMin = 50 * time.Millisecond
	blockRetryMax = 250 * time.Millisecond
	// blockHealthCheck is how long the subscription may be silent before
	// it is pinged, and how long the ping may go unanswered before the
	// subscription counts as dead: a node whose host died sends nothing,
	// not even the end of the connection.
	blockHealthCheck = time.Second
)

// takeBlocks subscribes to blockChannel and notes every block announced
// until the subscription fails; it returns why. Once subscribed, it calls
// subscribed, and beside that it reads back the blocks in force, then calls
// readBack: the connections the reads take may be as dead as the one the
// subscription had, and take a while to time out.
func (s *Scheduler) takeBlocks(ctx context.Context, subscribed, readBack func()) error {
	sub := s.rdb.Subscribe(ctx, blockChannel)
	defer sub.Close()
	// A read under way does not watch ctx: closing ends it.
	defer context.AfterFunc(ctx, func() { sub.Close() })()
	if _, err := sub.Receive(ctx); err != nil { // the subscription's confirmation
		return err
	}
	subscribed()
	go func() {
		s.readBlocks(ctx)
		readBack()
	}()
	pinged := false
	for {
		msg, err := sub.ReceiveTimeout(ctx, blockHealthCheck)
		var netErr net.Error
		silent := errors.As(err, &netErr) && netErr.Timeout() && ctx.Err() == nil
		switch {
		case silent && !pinged:
			if err := sub.Ping(ctx); err != nil {
				return err
			}
			pinged = true
			continue
		case silent:
			return fmt.Errorf("jobs: no answer to a ping on the subscription to blocks within %v: %w", blockHealthCheck, err)
		case err != nil:
			return err
		}
		pinged = false
		if m, ok := msg.(*redis.Message); ok {
			s.takeBlock(m.Payload)
		}
	}
}

// takeBlock notes the block a message of blockChannel announces, if it is
// of a quota of the config in force: "<quota> <µs>", or "<quota> <µs>
// k=<digest>" for one value of a keyed quota (see keyBlock). The quota's
// name is all before the duration: it may hold spaces itself.
func (s *Scheduler) takeBlock(payload string) {
	digest, rest, keyed := parseKeyBlock(payload)
	if keyed {
		payload = rest
	}
	i := strings.LastIndexByte(payload, ' ')
	if i < 0 {
		return
	}
	quota := payload[:i]
	us, err := strconv.ParseInt(payload[i+1:], 10, 64)
	g, known := s.gates.Load().quotas[quota]
	if !known || err != nil || us <= 0 || us > math.MaxInt64/int64(time.Microsecond) || keyed != (g.expr != nil) {
		return
	}
	now := s.clock.Now()
	until := now.Add(time.Duration(us) * time.Microsecond)
	if keyed {
		s.keyBlocks.add(keyBlock{quota: quota, digest: digest}, until, now)
		return
	}
	s.block(quota, until)
}

// readBlocks notes the blocks in force on the quotas (Reserver.Peek): set
// while this worker was not subscribed, their messages never reached it.
func (s *Scheduler) readBlocks(ctx context.Context) {
	for _, g := range s.gates.Load().quotas {
		if g.expr != nil {
			continue // a keyed quota's blocks are per key value, in Redis only
		}
		level, err := g.lim.Peek(ctx, g.key)
		if err != nil {
			s.log.Warn("cannot read back whether a quota is blocked", "quota", g.key, "err", err)
			continue
		}
		if level.BlockedFor > 0 {
			s.block(g.key, s.clock.Now().Add(level.BlockedFor))
		}
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

// blockedUntil is the latest block on the quotas of task t, id in queue,
// that this worker knows of, or the zero Time: on a keyed quota, the block
// on the task's key value.
func (s *Scheduler) blockedUntil(gs *gateSet, queue, id string, t *asynq.Task) time.Time {
	var until time.Time
	var vars *taskVars
	now := s.clock.Now()
	for _, g := range gs.routeOf(queue, t.Type()).quotas {
		if g.expr != nil {
			if s.keyBlocks.empty() {
				continue
			}
			if vars == nil {
				vars = varsOf(queue, id, t)
			}
			if u := s.keyBlocks.blockedUntil(blockOfKey(g.key, s.claimOf(g, vars).key), now); u.After(until) {
				until = u
			}
			continue
		}
		if v, ok := s.blocked.Load(g.key); ok && v.(time.Time).After(until) {
			until = v.(time.Time)
		}
	}
	return until
}

// Warm readies the Scheduler's path to Redis before the first task: a peek
// at every gate opens connections to the servers that hold them and loads
// the limiters' functions (or script) there, and the wake set's script is
// loaded. Else the first tasks pay for that while their turns run: a turn
// answered late is used late, and on a drain of burst 1 the next one, on
// time, comes too close after it.
func (s *Scheduler) Warm(ctx context.Context) error {
	gs := s.gates.Load()
	var errs []error
	for _, gates := range []map[string]*gate{gs.drains, gs.quotas} {
		for _, g := range gates {
			if _, err := g.lim.Peek(ctx, g.key); err != nil {
				errs = append(errs, fmt.Errorf("%s: %w", g.name, err))
			}
		}
	}
	if err := wakeScript.Load(ctx, s.rdb).Err(); err != nil {
		errs = append(errs, fmt.Errorf("wake script: %w", err))
	}
	return errors.Join(errs...)
}
