package jobs

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
)

// Run keeps the Scheduler's view of the fleet fresh until ctx ends, with
// one service each: the number of live workers (fleetSize: the local
// policy waits until it has counted them), the quotas an upstream blocked
// (blockBoard), the tasks that waited in Redis brought back when they are
// due (waker), the tasks orphaned by a worker's death run again
// (orphanRescue), and this worker's completions added to the queues'
// rates (rateRecorder, for RecentRate), the runtime limits (limitsWatch),
// the adaptive quotas' learned rates (adaptiveRates) and the sharded
// queues' shares of their drains (shareKeeper). It returns once
// all of them, and
// the work of any config change (Apply), have stopped.
func (s *Scheduler) Run(ctx context.Context) {
	s.changes.open(ctx)
	defer s.changes.close()
	runAll(ctx, s.fleet, s.board, s.waker, s.parker, s.rescuer, s.rates, s.limits, s.adapt, s.shares)
}

// orphanRescue runs again, every rescueEvery, the tasks that asynq
// archived only because the worker running them died (see rescue).
type orphanRescue struct {
	fleetDeps
	inspector *asynq.Inspector
}

// rescueEvery is how often a worker of the fleet looks for orphans.
const rescueEvery = 5 * time.Second

func (r *orphanRescue) run(ctx context.Context) {
	tick := time.NewTicker(rescueEvery)
	defer tick.Stop()
	for {
		r.rescueOrphans(ctx)
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}

// rescueOrphans runs again the tasks that asynq archived only because the
// worker running them died and they had no retry left (MaxRetry 0): one
// worker death is forgiven (a deploy), a second is not (see rescue). For
// each queue, one worker of the fleet looks, every few seconds, at its
// newest 200 archived tasks (a crash orphans at most the tasks its worker was
// running).
func (r *orphanRescue) rescueOrphans(ctx context.Context) {
	const page = 100
	for queue := range r.gates().cfg.Queues {
		if ok, err := r.rdb.SetNX(ctx, orphanClaim(queue), r.worker, 4*time.Second).Result(); err != nil || !ok {
			continue
		}
		// The size of the archive alone: Inspector.GetQueueInfo would also
		// sample the memory of the queue's tasks, some 30 commands.
		archived, err := r.queues.ZCard(ctx, asynqKeys(queue)+"archived").Result()
		if err != nil || archived == 0 {
			continue
		}
		// Archived tasks are listed oldest first: look at the last two pages.
		last := int((archived-1)/page + 1)
		for p := max(1, last-1); p <= last; p++ {
			tasks, err := r.inspector.ListArchivedTasks(queue, asynq.PageSize(page), asynq.Page(p))
			if err != nil {
				break
			}
			for _, t := range tasks {
				if r.rescue(ctx, queue, t) {
					r.log.Info("a task archived when its worker died runs again", "queue", queue, "id", t.ID)
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
func (r *orphanRescue) rescue(ctx context.Context, queue string, t *asynq.TaskInfo) bool {
	if t.LastErr != asynq.ErrLeaseExpired.Error() || t.MaxRetry > 0 {
		return false
	}
	key := rescuedKey(queue, t.ID)
	first, err := r.rdb.SetNX(ctx, key, "rescued", rescueMemory).Result()
	switch {
	case err != nil:
		return false
	case !first:
		// Report it once: the mark says so.
		if was, err := r.rdb.SetArgs(ctx, key, "reported", redis.SetArgs{Get: true, KeepTTL: true}).Result(); err == nil && was == "rescued" {
			r.log.Warn("a task whose runs ended in worker deaths twice stays archived", "queue", queue, "id", t.ID, "type", t.Type)
		}
		return false
	}
	return r.inspector.RunTask(queue, t.ID) == nil
}

// rescueMemory is how long a rescued task is remembered as rescued.
const rescueMemory = 24 * time.Hour

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
