package jobs

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/throttle"
)

// TaskState is where a task is on its way to its handler, as ETA tells it.
type TaskState string

const (
	// TaskRunning: a worker has it: its handler runs, or it holds for its
	// turn (At) in the worker.
	TaskRunning TaskState = "running"
	// TaskBooked: it waits in Redis for the turn it booked (At): its
	// predicted start.
	TaskBooked TaskState = "booked"
	// TaskAsksAgain: it waits in Redis with no turn booked yet, and asks
	// its gates again at At (a turn further than worker.reserve_max, its
	// place in a backlog line, an upstream's block).
	TaskAsksAgain TaskState = "asks_again"
	// TaskPending: in its queue's pending list at Position (1 runs next);
	// At is predicted from its gates' rates and the backlog ahead of it.
	TaskPending TaskState = "pending"
	// TaskScheduled: its producer scheduled it for At; it books then.
	TaskScheduled TaskState = "scheduled"
	// TaskRetry: it failed and is retried at At.
	TaskRetry TaskState = "retry"
	// TaskArchived, TaskCompleted: it will not run again.
	TaskArchived  TaskState = "archived"
	TaskCompleted TaskState = "completed"
)

// TaskETA is when one task is predicted to start, and why.
type TaskETA struct {
	Queue string `json:"queue"`
	ID    string `json:"id"`
	// WaitsAs is the id of the copy the task waits as (a task with no
	// retry left goes back to Redis as a copy, <id>~<hop>), or "".
	WaitsAs string    `json:"waits_as,omitempty"`
	Type    string    `json:"type"`
	State   TaskState `json:"state"`
	// At is its predicted start, on the limiters' clock; zero when there
	// is none (archived, completed, or running past its turn).
	At time.Time `json:"at,omitzero"`
	// Position, for a pending task: 1 is taken next.
	Position int `json:"position,omitempty"`
	// Paused: its queue is paused; At is as if it ran now.
	Paused bool `json:"paused,omitempty"`
	// Now is the limiters' clock when the task was read.
	Now time.Time `json:"now"`
}

// Wait is how long from Now until At (0 if At is not later).
func (e TaskETA) Wait() time.Duration {
	if e.At.IsZero() {
		return 0
	}
	return max(0, e.At.Sub(e.Now))
}

// TaskNotFoundError is ETA's answer for a task id that no queue it
// searched holds.
type TaskNotFoundError struct {
	ID     string
	Queues []string // searched
}

func (e *TaskNotFoundError) Error() string {
	where := fmt.Sprintf("any of the queues %q", e.Queues)
	if len(e.Queues) == 1 {
		where = fmt.Sprintf("queue %q", e.Queues[0])
	}
	return fmt.Sprintf("jobs: no task %q in %s, nor a copy it waits as (a task that ran is kept only with a retention)", e.ID, where)
}

// AmbiguousTaskError is ETA's answer, with no queue named, for a task id
// that more than one queue holds (asynq's ids are unique per queue only).
type AmbiguousTaskError struct {
	ID     string
	Queues []string // holding it
}

func (e *AmbiguousTaskError) Error() string {
	return fmt.Sprintf("jobs: task %q is in the queues %q: name its queue", e.ID, e.Queues)
}

// maxTaskID bounds an id ETA takes: asynq takes any length, but a
// longer one is a mistake, and it goes into keys.
const maxTaskID = 1024

// MaxTaskETAs bounds how many tasks QueueETAs lists.
const MaxTaskETAs = 1000

// ETA tells when task id of queue is predicted to start, with cfg (the
// config in force) and the limiters' state in limits and asynq's in
// queues (often one client). With queue "", every queue of cfg and of
// asynq is searched. A task waiting in Redis for its turn is read from the
// wake set and the turn kept under its booking ID; a pending one is
// predicted from its position and its gates' rates and levels. It reads
// only (a level's read may drop what has expired). An id no queue holds is
// a *TaskNotFoundError; searched for in every queue, an id more than one
// holds is an *AmbiguousTaskError.
func ETA(ctx context.Context, limits, queues redis.UniversalClient, cfg Config, queue, id string) (TaskETA, error) {
	if id == "" || len(id) > maxTaskID {
		return TaskETA{}, fmt.Errorf("jobs: a task id is 1 to %d bytes, got %d", maxTaskID, len(id))
	}
	r, err := newETAReader(ctx, limits, queues, cfg)
	if err != nil {
		return TaskETA{}, err
	}
	defer r.inspector.Close()
	search := []string{queue}
	if queue == "" {
		if search, err = r.allQueues(); err != nil {
			return TaskETA{}, err
		}
		holding, err := r.holders(ctx, search, id)
		switch {
		case err != nil:
			return TaskETA{}, err
		case len(holding) == 0:
			return TaskETA{}, &TaskNotFoundError{ID: id, Queues: search}
		case len(holding) > 1:
			return TaskETA{}, &AmbiguousTaskError{ID: id, Queues: holding}
		}
		queue = holding[0]
	}
	info, err := r.find(ctx, queue, id)
	if err != nil {
		return TaskETA{}, err
	}
	if info == nil {
		return TaskETA{}, &TaskNotFoundError{ID: id, Queues: search}
	}
	return r.etaOf(ctx, queue, info, 0)
}

// QueueETAs lists up to top (1 to MaxTaskETAs) of queue's tasks that wait
// to start, soonest first, each as ETA tells it: those running or holding
// in a worker, those waiting in Redis for their turn (the soonest due),
// and the first pending ones.
func QueueETAs(ctx context.Context, limits, queues redis.UniversalClient, cfg Config, queue string, top int) ([]TaskETA, error) {
	if top < 1 || top > MaxTaskETAs {
		return nil, fmt.Errorf("jobs: the tasks listed must be 1 to %d, got %d", MaxTaskETAs, top)
	}
	r, err := newETAReader(ctx, limits, queues, cfg)
	if err != nil {
		return nil, err
	}
	defer r.inspector.Close()
	var infos []*asynq.TaskInfo
	active, err := r.inspector.ListActiveTasks(queue, asynq.PageSize(top))
	if err != nil && !errors.Is(err, asynq.ErrQueueNotFound) {
		return nil, fmt.Errorf("jobs: %s's running tasks: %w", queue, err)
	}
	infos = append(infos, active...)
	due, err := limits.ZRangeWithScores(ctx, wakeKeys(queue)[0], 0, int64(top-1)).Result()
	if err != nil {
		return nil, fmt.Errorf("jobs: %s's wake set: %w", queue, err)
	}
	for _, z := range due {
		id, _ := z.Member.(string)
		info, err := r.inspector.GetTaskInfo(queue, id)
		if err != nil {
			continue // it ran meanwhile
		}
		infos = append(infos, info)
	}
	etas := make([]TaskETA, 0, len(infos)+top)
	for _, info := range infos {
		e, err := r.etaOf(ctx, queue, info, 0)
		if err != nil {
			return nil, err
		}
		etas = append(etas, e)
	}
	pending, err := r.inspector.ListPendingTasks(queue, asynq.PageSize(top))
	if err != nil && !errors.Is(err, asynq.ErrQueueNotFound) {
		return nil, fmt.Errorf("jobs: %s's pending tasks: %w", queue, err)
	}
	for i, info := range pending { // the next to be taken first
		e, err := r.etaOf(ctx, queue, info, i+1)
		if err != nil {
			return nil, err
		}
		etas = append(etas, e)
	}
	slices.SortStableFunc(etas, func(a, b TaskETA) int {
		return cmp.Or(compareBool(a.At.IsZero(), b.At.IsZero()), a.At.Compare(b.At))
	})
	return etas[:min(top, len(etas))], nil
}

// etaReader reads what ETA needs, with the limiters' clock read once.
type etaReader struct {
	limits    redis.UniversalClient
	queues    redis.UniversalClient
	inspector *asynq.Inspector
	gs        *gateSet
	now       time.Time
	paused    map[string]bool
	pending   map[string]int   // by queue: the length of its pending list
	fronts    map[string]front // by gate name and key
}

// front is when a gate can next give a turn of some cost, and how far
// apart its turns of that cost are.
type front struct {
	free     time.Time
	interval time.Duration
}

func newETAReader(ctx context.Context, limits, queues redis.UniversalClient, cfg Config) (*etaReader, error) {
	gs, err := newGateSet(limits, cfg.Defaults(), gateOptions{lease: slotLease})
	if err != nil {
		return nil, err
	}
	now, err := limits.Time(ctx).Result()
	if err != nil {
		return nil, fmt.Errorf("jobs: reading the limiters' clock: %w", err)
	}
	return &etaReader{limits: limits, queues: queues, inspector: asynq.NewInspectorFromRedisClient(queues), gs: gs,
		now: now, paused: map[string]bool{}, pending: map[string]int{}, fronts: map[string]front{}}, nil
}

// allQueues lists the config's queues, then any other asynq knows.
func (r *etaReader) allQueues() ([]string, error) {
	known, err := r.inspector.Queues()
	if err != nil {
		return nil, fmt.Errorf("jobs: listing queues: %w", err)
	}
	names := slices.Sorted(maps.Keys(r.gs.cfg.Queues))
	for _, q := range slices.Sorted(slices.Values(known)) {
		if !slices.Contains(names, q) {
			names = append(names, q)
		}
	}
	return names, nil
}

// holders returns the queues of search that hold task id, or else those
// that hold a copy it waits as: a pipeline of EXISTS, not a lookup per
// queue (a server may hold hundreds of queues).
func (r *etaReader) holders(ctx context.Context, search []string, id string) ([]string, error) {
	have := func(name func(queue string) []string) ([]string, error) {
		var keys []string
		for _, q := range search {
			keys = append(keys, name(q)...)
		}
		found, err := existing(ctx, r.queues, keys)
		if err != nil {
			return nil, fmt.Errorf("jobs: looking for task %q in %d queues: %w", id, len(search), err)
		}
		var holding []string
		per := len(keys) / len(search)
		for i, q := range search {
			if slices.Contains(found[i*per:(i+1)*per], true) {
				holding = append(holding, q)
			}
		}
		return holding, nil
	}
	holding, err := have(func(q string) []string { return []string{asynqKeys(q) + "t:" + id} })
	if err != nil || len(holding) > 0 {
		return holding, err
	}
	return have(func(q string) []string {
		copies := make([]string, maxHopsLooked)
		for hop := range copies {
			copies[hop] = asynqKeys(q) + "t:" + id + "~" + strconv.Itoa(hop+1)
		}
		return copies
	})
}

// existing tells which of keys exist, in pipelines of a bounded size.
func existing(ctx context.Context, rdb redis.UniversalClient, keys []string) ([]bool, error) {
	const perTrip = 4096
	found := make([]bool, len(keys))
	for start := 0; start < len(keys); start += perTrip {
		chunk := keys[start:min(start+perTrip, len(keys))]
		pipe := rdb.Pipeline()
		cmds := make([]*redis.IntCmd, len(chunk))
		for i, k := range chunk {
			cmds[i] = pipe.Exists(ctx, k)
		}
		if _, err := pipe.Exec(ctx); err != nil {
			return nil, err
		}
		for i, c := range cmds {
			found[start+i] = c.Val() > 0
		}
	}
	return found, nil
}

// maxHopsLooked bounds the copies of a task find looks for: a task goes
// back as a copy once each time it must wait with no retry left.
const maxHopsLooked = 32

// find returns task id of queue, or the copy it waits as, or nil if there
// is neither.
func (r *etaReader) find(ctx context.Context, queue, id string) (*asynq.TaskInfo, error) {
	info, err := r.inspector.GetTaskInfo(queue, id)
	if err == nil {
		return info, nil
	}
	if !errors.Is(err, asynq.ErrTaskNotFound) && !errors.Is(err, asynq.ErrQueueNotFound) {
		return nil, fmt.Errorf("jobs: task %q of queue %q: %w", id, queue, err)
	}
	// Its copies are <id>~<hop> (copyForLater); the latest is the live one.
	pipe := r.queues.Pipeline()
	exists := make([]*redis.IntCmd, maxHopsLooked)
	for hop := range exists {
		exists[hop] = pipe.Exists(ctx, asynqKeys(queue)+"t:"+id+"~"+strconv.Itoa(hop+1))
	}
	if _, err := pipe.Exec(ctx); err != nil {
		return nil, fmt.Errorf("jobs: looking for copies of task %q in queue %q: %w", id, queue, err)
	}
	for hop := maxHopsLooked; hop >= 1; hop-- {
		if exists[hop-1].Val() == 0 {
			continue
		}
		info, err := r.inspector.GetTaskInfo(queue, id+"~"+strconv.Itoa(hop))
		if err == nil {
			return info, nil
		}
	}
	return nil, nil
}

// etaOf tells info's ETA; position, if known, is a pending task's.
func (r *etaReader) etaOf(ctx context.Context, queue string, info *asynq.TaskInfo, position int) (TaskETA, error) {
	e := TaskETA{Queue: queue, ID: info.ID, Type: info.Type, Now: r.now}
	if origin := info.Headers[headerOrigin]; origin != "" {
		e.ID, e.WaitsAs = origin, info.ID
	}
	t := asynq.NewTaskWithHeaders(info.Type, info.Payload, info.Headers)
	route := r.gs.routeOf(queue, info.Type)
	var claims []claim
	if len(route.gates) > 0 {
		claims = quietClaims(route, varsOf(queue, info.ID, t))
	}
	kept := func() (time.Time, bool, error) {
		if len(claims) == 0 {
			return time.Time{}, false, nil
		}
		// Every claim keeps the turn at one instant (throttle.Book): the
		// first's tells it.
		return throttle.KeptTurn(ctx, claims[0].lim, claims[0].key, bookingID(queue, info.ID, t))
	}
	switch info.State {
	case asynq.TaskStateActive:
		e.State = TaskRunning
		at, ok, err := kept()
		if err != nil {
			return e, err
		}
		if ok && at.After(r.now) {
			e.At = at
		}
	case asynq.TaskStatePending:
		if at, ok, err := kept(); err != nil || ok {
			// Back from Redis for the turn it booked, due at once.
			e.State, e.At = TaskBooked, at
			return e, err
		}
		e.State = TaskPending
		if position == 0 {
			var err error
			if position, err = r.position(ctx, queue, info.ID); err != nil {
				return e, err
			}
		}
		e.Position = position
		at, err := r.predict(ctx, queue, info.Type, route, claims, position)
		if err != nil {
			return e, err
		}
		e.At = at
		if e.Paused, err = r.isPaused(queue); err != nil {
			return e, err
		}
	case asynq.TaskStateRetry, asynq.TaskStateScheduled:
		due, err := r.limits.ZScore(ctx, wakeKeys(queue)[0], info.ID).Result()
		if err != nil && !errors.Is(err, redis.Nil) {
			return e, fmt.Errorf("jobs: %s's wake set: %w", queue, err)
		}
		if err == nil {
			at, ok, err := kept()
			if err != nil {
				return e, err
			}
			if ok {
				e.State, e.At = TaskBooked, at
			} else {
				e.State, e.At = TaskAsksAgain, time.UnixMicro(int64(due))
			}
			break
		}
		switch {
		case WaitingTask(info):
			// Not noted (its worker could not): asynq brings it back.
			e.State = TaskAsksAgain
		case info.State == asynq.TaskStateRetry:
			e.State = TaskRetry
		default:
			e.State = TaskScheduled
		}
		e.At = info.NextProcessAt
	case asynq.TaskStateArchived:
		e.State = TaskArchived
	default:
		e.State = TaskCompleted
	}
	return e, nil
}

// position is where task id is in queue's pending list: 1 is taken next.
func (r *etaReader) position(ctx context.Context, queue, id string) (int, error) {
	key := asynqKeys(queue) + "pending"
	pipe := r.queues.Pipeline()
	length := pipe.LLen(ctx, key)
	pos := pipe.LPos(ctx, key, id, redis.LPosArgs{})
	if _, err := pipe.Exec(ctx); err != nil && !errors.Is(err, redis.Nil) {
		return 0, fmt.Errorf("jobs: %s's pending list: %w", queue, err)
	}
	if pos.Err() != nil {
		return 1, nil // taken meanwhile
	}
	return int(length.Val() - pos.Val()), nil // asynq takes from the right
}

// predict is when a task of typ at position of queue, on route with
// claims, is predicted to start: each of its rate gates gives a turn once
// those it booked already are past (and its backlog line, if it has one),
// then one per task ahead at its rate (for a quota, the other queues'
// tasks that share it too); the latest gate says.
func (r *etaReader) predict(ctx context.Context, queue, typ string, route *route, claims []claim, position int) (time.Time, error) {
	at := r.now
	tail, err := r.limits.ZScore(ctx, queueLines(queue), lineTail).Result()
	if err != nil && !errors.Is(err, redis.Nil) {
		return at, fmt.Errorf("jobs: %s's backlog lines: %w", queue, err)
	}
	if line := time.UnixMicro(int64(tail)); err == nil && line.After(at) {
		at = line
	}
	start := at
	for i, c := range claims {
		if c.g.fair || c.g.limit.Limit <= 0 {
			continue
		}
		f, err := r.frontOf(ctx, c, route.cost)
		if err != nil {
			return at, err
		}
		ahead := position - 1
		if i > 0 || r.gs.drains[queue] == nil {
			// A quota: the other queues' pending tasks that share it are
			// taken meanwhile too, in proportion to the queues' priorities.
			others, err := r.sharingAhead(ctx, queue, typ, c.g, position-1)
			if err != nil {
				return at, err
			}
			ahead += others
		}
		start = maxTime(start, maxTime(f.free, at).Add(time.Duration(ahead)*f.interval))
	}
	return start, nil
}

// sharingAhead is how many pending tasks of other queues whose tasks of
// typ meet gate g the workers take while they take ahead of queue's: each
// queue in proportion to its priority, at most as many as it has.
func (r *etaReader) sharingAhead(ctx context.Context, queue, typ string, g *gate, ahead int) (int, error) {
	weight := func(q string) int { return max(1, r.gs.cfg.Queues[q].Priority) }
	others := 0
	for other := range r.gs.cfg.Queues {
		if other == queue || !slices.Contains(r.gs.routeOf(other, typ).gates, g) {
			continue
		}
		n, ok := r.pending[other]
		if !ok {
			length, err := r.queues.LLen(ctx, asynqKeys(other)+"pending").Result()
			if err != nil {
				return 0, fmt.Errorf("jobs: %s's pending list: %w", other, err)
			}
			n = int(length)
			r.pending[other] = n
		}
		others += min(n, ahead*weight(other)/weight(queue))
	}
	return others, nil
}

// frontOf reads when claim c's gate next gives a turn of cost (its level),
// once per gate and key.
func (r *etaReader) frontOf(ctx context.Context, c claim, cost int) (front, error) {
	id := c.g.name + "\x00" + c.key
	if f, ok := r.fronts[id]; ok {
		return f, nil
	}
	limit := c.g.limit
	if ov := c.g.overrides.of(c.key, true); ov != nil {
		limit = ov.limit
	}
	spec := limit.Spec().WithDefaults()
	interval := time.Duration(int64(cost) * int64(spec.Period) / int64(spec.Limit))
	level, err := c.lim.Peek(ctx, c.key)
	if err != nil {
		return front{}, fmt.Errorf("jobs: the level of %s: %w", c.g.name, err)
	}
	free := r.now.Add(level.BlockedFor)
	switch spec.Algorithm {
	case throttle.TokenBucket, throttle.LeakyBucket:
		// What it counted drains at its rate: room for cost once the level
		// is down to capacity - cost.
		free = maxTime(free, r.now.Add(level.ResetAfter-time.Duration(spec.Capacity()-cost)*interval/time.Duration(cost)))
	default:
		if level.Remaining < cost {
			free = maxTime(free, r.now.Add(level.ResetAfter))
		}
	}
	f := front{free: free, interval: interval}
	r.fronts[id] = f
	return f, nil
}

func (r *etaReader) isPaused(queue string) (bool, error) {
	if p, ok := r.paused[queue]; ok {
		return p, nil
	}
	info, err := r.inspector.GetQueueInfo(queue)
	if err != nil {
		return false, fmt.Errorf("jobs: queue %q: %w", queue, err)
	}
	r.paused[queue] = info.Paused
	return info.Paused, nil
}

func maxTime(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}
