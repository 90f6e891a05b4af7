package jobs

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/throttle"
)

// A plan predicts how a backlog drains before it is enqueued: every task
// books its turn on its gates as a worker would, in the order the fleet
// would take them, on in-process twins of the gates (throttle.NewLocal) run
// on a clock of the plan's own. No time passes and nothing in Redis is
// touched. What it does not model: concurrency limits and the time
// handlers take (a plan predicts when each task starts, and so when each
// queue has none left waiting), fair shares within a queue (they reorder
// its tasks, not its drain), and upstreams that say "not now".

// PlanTask is one task a plan counts: in Redis already, or still to be
// enqueued.
type PlanTask struct {
	Queue   string
	Type    string
	ID      string // for key expressions that read it; may be ""
	Payload []byte
	Headers map[string]string
	// Ready is the earliest it may start; zero: at once. A task waiting in
	// Redis for its turn is ready at its turn, and one a producer
	// scheduled at its time.
	Ready time.Time
	// Booked: it waits in Redis for a turn its gates counted already
	// (noted in the wake set): the plan books it first, at Ready.
	Booked bool
	// Enqueued: in Redis already (not from a file).
	Enqueued bool
}

// Plan is what PlanOf predicts.
type Plan struct {
	Now    time.Time   `json:"now"`
	Tasks  int         `json:"tasks"`
	Empty  time.Time   `json:"empty_at"` // when the last task of all starts
	Queues []QueuePlan `json:"queues"`
	Quotas []QuotaPlan `json:"quotas"`
}

// QueuePlan is one queue's part of a plan.
type QueuePlan struct {
	Name     string `json:"name"`
	Tasks    int    `json:"tasks"`
	InRedis  int    `json:"in_redis"`  // of Tasks, in Redis already
	FromFile int    `json:"from_file"` // of Tasks, still to enqueue
	// Empty is when its last task starts: from then on none waits.
	Empty time.Time `json:"empty_at"`
	// Seconds is how long from the plan's Now until Empty.
	Seconds float64 `json:"seconds"`
	// DrainBusy is the share of its drain's capacity its tasks use from
	// Now until Empty (1: the drain is what holds the queue back); absent
	// without a drain.
	DrainBusy *float64 `json:"drain_busy,omitempty"`
	// Configured: the config names it; no worker serves a queue it does
	// not (its tasks are counted as starting at once).
	Configured bool `json:"configured"`
}

// QuotaPlan is how busy one quota is in a plan.
type QuotaPlan struct {
	Name   string `json:"name"`
	Events int    `json:"events"` // the events the plan's tasks draw from it
	// Until is the last turn it gives them (zero: none).
	Until time.Time `json:"busy_until,omitzero"`
	// Busy is the share of its capacity they use from Now until Until: 1
	// is a quota in use all along, the one that holds its tasks back.
	// Absent for a keyed quota (each key value has a capacity of its own).
	Busy *float64 `json:"busy,omitempty"`
}

// MaxPlanTasks bounds the tasks one plan takes: each is held in memory.
const MaxPlanTasks = 2_000_000

// virtualClock is a plan's clock: it moves only when the plan moves it,
// and nothing in a plan waits on it.
type virtualClock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *virtualClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *virtualClock) set(t time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = t
}

// After never fires: nothing in a plan waits.
func (c *virtualClock) After(time.Duration) <-chan time.Time { return nil }

// PlanOf predicts, from cfg (the config in force, overrides included),
// when tasks start, starting at now: tasks Booked first, at their turns;
// then each queue's in order (by Ready, then as given), the queues taken
// in turn by their priority weights, as asynq's workers take them. Every
// task books its turn on its gates at the plan's clock; a turn further
// than worker.reserve_max moves the clock on, as a backlog line does.
func PlanOf(cfg Config, now time.Time, tasks []PlanTask) (Plan, error) {
	if len(tasks) > MaxPlanTasks {
		return Plan{}, fmt.Errorf("jobs: a plan takes at most %d tasks, got %d", MaxPlanTasks, len(tasks))
	}
	cfg = cfg.Defaults()
	clock := &virtualClock{t: now}
	gs, err := newGateSet(nil, cfg, gateOptions{lease: slotLease, local: true, clock: clock})
	if err != nil {
		return Plan{}, err
	}
	p := &planner{gs: gs, clock: clock, now: now, reserve: cfg.Worker.ReserveMax,
		queues: map[string]*queuePlanning{}, quotas: map[string]*quotaPlanning{}}
	var booked []*PlanTask
	for i := range tasks {
		t := &tasks[i]
		q := p.queue(t.Queue)
		q.plan.Tasks++
		if t.Enqueued {
			q.plan.InRedis++
		} else {
			q.plan.FromFile++
		}
		if t.Booked && !t.Ready.After(now.Add(p.reserve)) {
			booked = append(booked, t)
			continue
		}
		q.tasks = append(q.tasks, t)
	}
	// The turns booked already, soonest first: they are counted in the
	// gates before any other task books.
	slices.SortStableFunc(booked, func(a, b *PlanTask) int { return a.Ready.Compare(b.Ready) })
	for _, t := range booked {
		if err := p.book(t); err != nil {
			return Plan{}, err
		}
	}
	p.clock.set(now)
	for _, q := range p.queues {
		slices.SortStableFunc(q.tasks, func(a, b *PlanTask) int { return maxTime(a.Ready, now).Compare(maxTime(b.Ready, now)) })
	}
	// Smooth weighted round robin: each queue is taken in proportion to
	// its priority, evenly spread, as asynq's workers do on average.
	names := slices.Sorted(maps.Keys(p.queues))
	for {
		var next *queuePlanning
		total := 0
		// The plan's clock follows the queue furthest behind: what the
		// gates counted before it is past for every queue, and dropped.
		behind := time.Time{}
		for _, name := range names {
			q := p.queues[name]
			if q.next >= len(q.tasks) {
				continue
			}
			if behind.IsZero() || q.cursor.Before(behind) {
				behind = q.cursor
			}
			q.credit += q.weight
			total += q.weight
			if next == nil || q.credit > next.credit {
				next = q
			}
		}
		if next == nil {
			break
		}
		p.clock.set(maxTime(p.clock.Now(), behind))
		next.credit -= total
		if err := p.book(next.tasks[next.next]); err != nil {
			return Plan{}, err
		}
		next.next++
	}
	return p.result(len(tasks)), nil
}

// planner is one plan's state.
type planner struct {
	gs      *gateSet
	clock   *virtualClock
	now     time.Time
	reserve time.Duration
	queues  map[string]*queuePlanning
	quotas  map[string]*quotaPlanning
}

type queuePlanning struct {
	plan  QueuePlan
	tasks []*PlanTask
	next  int // the next of tasks to book
	// cursor is its latest turn: its tasks are taken in order, and none
	// books before the one taken before it.
	cursor time.Time
	weight int
	credit int // smooth weighted round robin
	events int // drawn from its drain
	drain  *gate
}

type quotaPlanning struct {
	g      *gate
	events int
	until  time.Time
}

func (p *planner) queue(name string) *queuePlanning {
	q := p.queues[name]
	if q == nil {
		qc, ok := p.gs.cfg.Queues[name]
		q = &queuePlanning{plan: QueuePlan{Name: name, Configured: ok}, weight: max(1, qc.Priority), drain: p.gs.drains[name], cursor: p.now}
		p.queues[name] = q
	}
	return q
}

// book books task t's turn on its gates, from the plan's clock, and notes
// its start.
func (p *planner) book(t *PlanTask) error {
	q := p.queue(t.Queue)
	start := maxTime(maxTime(t.Ready, q.cursor), p.clock.Now())
	if q.plan.Configured {
		route := p.gs.routeOf(t.Queue, t.Type)
		if len(route.gates) > 0 {
			var vars *taskVars
			if route.keyed {
				vars = newTaskVars(t.Queue, t.ID, t.Type, t.Payload)
				vars.client = t.Headers[HeaderClient]
			}
			claims := quietClaims(route, vars)
			at, err := p.bookOn(claims, route.cost, start)
			if err != nil {
				return fmt.Errorf("jobs: planning a task of %s in %s: %w", t.Type, t.Queue, err)
			}
			start = at
			p.count(q, claims, route.cost, at)
		}
	}
	q.cursor = maxTime(q.cursor, start)
	if start.After(q.plan.Empty) {
		q.plan.Empty = start
	}
	return nil
}

// maxPlanMoves bounds how often one task's booking moves the plan's clock
// on.
const maxPlanMoves = 64

// bookOn books cost on claims not before notBefore and returns the turn.
// A turn further ahead than a gate books (throttle's horizon) moves the
// plan's clock on towards it: a task waits in a backlog line meanwhile.
func (p *planner) bookOn(claims []claim, cost int, notBefore time.Time) (time.Time, error) {
	bookClaims := make([]throttle.Claim, len(claims))
	for i, c := range claims {
		bookClaims[i] = throttle.Claim{Limiter: c.lim, Key: c.key, N: cost}
	}
	for range maxPlanMoves {
		bk, err := throttle.Book(context.Background(), bookClaims, notBefore, planHorizon)
		if err != nil {
			return time.Time{}, err
		}
		if bk.OK {
			return bk.At, nil
		}
		now := p.clock.Now()
		p.clock.set(maxTime(now.Add(time.Microsecond), now.Add(bk.Delay/2)))
	}
	return time.Time{}, errors.New("no turn found: a gate admits too little for its cost")
}

// planHorizon is how far ahead a plan books a turn at most (a gate's own
// horizon may be nearer).
const planHorizon = 24 * time.Hour

// count notes what a task booked at at drew from its gates.
func (p *planner) count(q *queuePlanning, claims []claim, cost int, at time.Time) {
	for _, c := range claims {
		if c.g == q.drain {
			q.events += cost
			continue
		}
		quota := p.quotas[c.g.name]
		if quota == nil {
			quota = &quotaPlanning{g: c.g}
			p.quotas[c.g.name] = quota
		}
		quota.events += cost
		if at.After(quota.until) {
			quota.until = at
		}
	}
}

// result sums the plan up.
func (p *planner) result(tasks int) Plan {
	plan := Plan{Now: p.now, Tasks: tasks, Empty: p.now, Queues: []QueuePlan{}, Quotas: []QuotaPlan{}}
	for _, name := range slices.Sorted(maps.Keys(p.queues)) {
		q := p.queues[name]
		q.plan.Empty = maxTime(q.plan.Empty, p.now)
		q.plan.Seconds = q.plan.Empty.Sub(p.now).Seconds()
		if q.drain != nil && q.drain.expr == nil {
			busy := busyShare(q.drain.limit, q.events, q.plan.Empty.Sub(p.now))
			q.plan.DrainBusy = &busy
		}
		plan.Empty = maxTime(plan.Empty, q.plan.Empty)
		plan.Queues = append(plan.Queues, q.plan)
	}
	for _, name := range slices.Sorted(maps.Keys(p.gs.quotas)) {
		g := p.gs.quotas[name]
		qp := QuotaPlan{Name: name}
		if quota := p.quotas[g.name]; quota != nil {
			qp.Events, qp.Until = quota.events, quota.until
			if g.expr == nil {
				busy := busyShare(g.limit, quota.events, quota.until.Sub(p.now))
				qp.Busy = &busy
			}
		}
		plan.Quotas = append(plan.Quotas, qp)
	}
	return plan
}

// busyShare is the share of limit l's capacity that events use over span
// from the plan's start: at most what it holds at once, plus its rate
// over the span.
func busyShare(l LimitConfig, events int, span time.Duration) float64 {
	spec := l.Spec().WithDefaults()
	if events == 0 || spec.Limit <= 0 {
		return 0
	}
	capacity := float64(spec.Capacity()) + float64(spec.Limit)*span.Seconds()/spec.Period.Seconds()
	return min(1, float64(events)/capacity)
}

// planPage is how many tasks BacklogTasks reads at once.
const planPage = 5000

// BacklogTasks reads the tasks waiting in Redis in every queue of cfg
// (the queues its fleet serves; queues: asynq's Redis; limits: the
// limiters', for the wake sets), for a plan: pending ones in the order they are taken, those
// waiting for their turn (noted in the wake set) booked at it, retries
// and scheduled ones at their time. Running, archived and completed tasks
// are not counted. It reads at most most tasks, and fails beyond.
func BacklogTasks(ctx context.Context, limits, queues redis.UniversalClient, cfg Config, most int) ([]PlanTask, error) {
	r, err := newETAReader(ctx, limits, queues, cfg)
	if err != nil {
		return nil, err
	}
	defer r.inspector.Close()
	names := slices.Sorted(maps.Keys(r.gs.cfg.Queues))
	var tasks []PlanTask
	add := func(info *asynq.TaskInfo, t PlanTask) error {
		if len(tasks) >= most {
			return fmt.Errorf("jobs: the backlog in Redis holds more than %d tasks, the most a plan reads", most)
		}
		t.Queue, t.Type, t.ID, t.Payload, t.Headers, t.Enqueued = info.Queue, info.Type, info.ID, info.Payload, info.Headers, true
		tasks = append(tasks, t)
		return nil
	}
	for _, q := range names {
		var wake map[string]float64
		for _, list := range []func(string, ...asynq.ListOption) ([]*asynq.TaskInfo, error){
			r.inspector.ListPendingTasks, r.inspector.ListRetryTasks, r.inspector.ListScheduledTasks,
		} {
			for page := 1; ; page++ {
				infos, err := list(q, asynq.PageSize(planPage), asynq.Page(page))
				if errors.Is(err, asynq.ErrQueueNotFound) {
					break
				}
				if err != nil {
					return nil, fmt.Errorf("jobs: reading queue %q: %w", q, err)
				}
				for _, info := range infos {
					t := PlanTask{}
					if info.State == asynq.TaskStatePending && backForTurn(info) {
						// The waker brought it back for its turn, which is
						// at most requeueLead away.
						t.Ready, t.Booked = r.now, true
					}
					if info.State != asynq.TaskStatePending {
						if wake == nil {
							if wake, err = r.wakeSet(ctx, q); err != nil {
								return nil, err
							}
						}
						t.Ready = info.NextProcessAt
						if due, ok := wake[info.ID]; ok {
							// Due back requeueLead before its turn (or
							// when it asks again).
							t.Ready, t.Booked = time.UnixMicro(int64(due)).Add(requeueLead), true
						}
					}
					if err := add(info, t); err != nil {
						return nil, err
					}
				}
				if len(infos) < planPage {
					break
				}
			}
		}
	}
	return tasks, nil
}

// backForTurn reports whether pending task info is back from waiting in
// Redis (its last error a wait's, or a copy made for its turn): it holds a
// turn booked before, or asks again now.
func backForTurn(info *asynq.TaskInfo) bool {
	return strings.HasPrefix(info.LastErr, waitErrorPrefix) || info.Headers[headerOrigin] != ""
}

// wakeSet reads queue's wake set whole: task id -> µs due.
func (r *etaReader) wakeSet(ctx context.Context, queue string) (map[string]float64, error) {
	zs, err := r.limits.ZRangeWithScores(ctx, wakeKeys(queue)[0], 0, -1).Result()
	if err != nil {
		return nil, fmt.Errorf("jobs: %s's wake set: %w", queue, err)
	}
	due := make(map[string]float64, len(zs))
	for _, z := range zs {
		if id, ok := z.Member.(string); ok {
			due[id] = z.Score
		}
	}
	return due, nil
}
