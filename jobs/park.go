package jobs

import (
	"context"
	"slices"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
	"google.golang.org/protobuf/encoding/protowire"

	"github.com/sluicehq/sluice/lua"
	"github.com/sluicehq/sluice/throttle"
)

// A backlog is parked in its lines, not taken task by task. Once a task of
// a queue has taken a ticket in a backlog line, the tasks queued behind it
// would each be taken by a worker, refused their turn and sent back to
// Redis for a ticket of their own: three script runs each (asynq's dequeue,
// a booking, asynq's retry) before the visit that runs them. The parker
// moves them into their lines from the head of the queue instead, a batch
// per script run (lua/park.lua): each gets the next ticket of its line, is
// noted in the wake set and rests in asynq's retry set, as a task sent back
// would, and comes back near its ticket to book its turn once. A task is
// parked only if it is fresh from its producer (never back from waiting,
// never failed) and one of its gates' lines reaches further than a worker
// holds a task for; any other task is left for the workers, so a task of
// another type behind no line is not held up by the backlog before it. A
// queue with fair shares is never parked: its tasks wait in their keys'
// lines (fair.go).
//
// One worker at a time parks a queue (a claim in Redis, parkLease); two
// would only repeat each other's reads, as a task is moved once (the
// script takes it from the pending list first).
const (
	// parkBatch is how many tasks one script run parks at most: a worker
	// takes some of the backlog's head too while the parker reads a batch,
	// which goes the long way (a batch of 64 left 18% of a backlog of
	// 10,000 to the workers, one of 256 5%).
	parkBatch = 256
	// parkBytes bounds what a batch reads of its tasks' messages: a batch
	// is smaller where they are large (the first has parkFirst, none fewer
	// than parkLeast).
	parkBytes = 4 << 20
	parkFirst = 32
	parkLeast = 8
	// parkRounds bounds the batches of one ask (the next deferral asks
	// again).
	parkRounds = 4096
	// parkLease is the life of a queue's parking claim, renewed by each
	// batch.
	parkLease = 5 * time.Second
)

// parkedError is the last error a parked task shows (asynq keeps it with
// the task; WaitingTask and enqueue status tell a waiting task by it).
const parkedError = waitErrorPrefix + "in its backlog line for its turn (not a failure)"

// parkedMark is appended to a parked task's asynq message: its error_msg
// field (7 in asynq's TaskMessage), which a later occurrence of a field in
// a protobuf message sets.
var parkedMark = protowire.AppendString(protowire.AppendTag(nil, 7, protowire.BytesType), parkedError)

var parkScript = redis.NewScript(lua.Park)

// parker parks the backlogs of the queues its worker's tasks found behind
// a line.
type parker struct {
	fleetDeps
	booker *booker

	mu     sync.Mutex
	asked  map[string]bool // queues to look at
	signal chan struct{}
}

func newParker(deps fleetDeps, b *booker) *parker {
	return &parker{fleetDeps: deps, booker: b, asked: map[string]bool{}, signal: make(chan struct{}, 1)}
}

// ask has the parker look at queue's backlog soon.
func (p *parker) ask(queue string) {
	p.mu.Lock()
	p.asked[queue] = true
	p.mu.Unlock()
	select {
	case p.signal <- struct{}{}:
	default:
	}
}

func (p *parker) run(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-p.signal:
		}
		p.mu.Lock()
		queues := make([]string, 0, len(p.asked))
		for q := range p.asked {
			queues = append(queues, q)
		}
		clear(p.asked)
		p.mu.Unlock()
		for _, q := range queues {
			p.parkBacklog(ctx, q)
		}
	}
}

// parkBacklog parks queue's backlog, a batch at a time, while its head has
// tasks to park and no other worker is at it.
func (p *parker) parkBacklog(ctx context.Context, queue string) {
	claim := parkClaim(queue)
	if ok, err := p.queues.SetNX(ctx, claim, p.worker, parkLease).Result(); err != nil || !ok {
		return
	}
	defer p.queues.Del(context.WithoutCancel(ctx), claim)
	size := parkFirst
	for range parkRounds {
		parked, read, next, err := p.parkBatch(ctx, queue, size)
		if err != nil {
			if ctx.Err() == nil {
				p.log.Warn("cannot park a queue's backlog in its lines; its workers take the tasks one by one", "queue", queue, "err", err)
			}
			return
		}
		if parked == 0 || read < size {
			return
		}
		size = next
		p.queues.PExpire(ctx, claim, parkLease)
	}
}

// parkBatch parks what it may of the size tasks at queue's head: parked is
// how many, read how many it looked at, and the next batch's size.
func (p *parker) parkBatch(ctx context.Context, queue string, size int) (parked, read, next int, err error) {
	gs := p.gates()
	if gs.fair[queue] != nil {
		return 0, 0, size, nil
	}
	prefix := asynqKeys(queue)
	ids, err := p.queues.LRange(ctx, prefix+"pending", int64(-size), -1).Result()
	if err != nil || len(ids) == 0 {
		return 0, 0, size, err
	}
	slices.Reverse(ids) // the head (asynq takes the right end) first
	pipe := p.queues.Pipeline()
	msgs := make([]*redis.StringCmd, len(ids))
	for i, id := range ids {
		msgs[i] = pipe.HGet(ctx, prefix+"t:"+id, "msg")
	}
	if _, err := pipe.Exec(ctx); err != nil && err != redis.Nil {
		return 0, 0, size, err
	}
	read, bytes := len(ids), 0
	for _, m := range msgs {
		bytes += len(m.Val())
	}
	next = min(parkBatch, max(parkLeast, read*parkBytes/max(bytes, 1)))
	type spot struct {
		id   string
		line backlogLine
	}
	var spots []spot
	var lineKeys []string // each line's key once, in spots' order
	tails := map[string]int64{}
	now := p.clock.Now()
	for i, id := range ids {
		m, ok := decodeTaskMessage([]byte(msgs[i].Val()))
		if !ok || !m.fresh() {
			continue
		}
		l, ok := p.lineOf(ctx, gs, queue, id, m, now, tails)
		if !ok {
			continue
		}
		if !slices.Contains(lineKeys, l.key) {
			lineKeys = append(lineKeys, l.key)
		}
		spots = append(spots, spot{id, l})
	}
	if len(spots) == 0 {
		return 0, read, next, nil
	}
	keys := append([]string{prefix + "pending", prefix + "retry", wakeKeys(queue)[0], queueLines(queue)}, lineKeys...)
	args := []any{prefix + "t:", requeueLead.Microseconds(), lineLife.Milliseconds(), parkedMark}
	intervals := make([]int64, len(lineKeys))
	for _, s := range spots {
		intervals[slices.Index(lineKeys, s.line.key)] = s.line.interval
	}
	for _, iv := range intervals {
		args = append(args, iv)
	}
	for _, s := range spots {
		args = append(args, s.id, slices.Index(lineKeys, s.line.key)+1)
	}
	tickets, err := parkScript.Run(ctx, p.queues, keys, args...).Int64Slice()
	if err != nil {
		return 0, read, next, err
	}
	lastTail := map[string]int64{}
	for i, ticket := range tickets {
		if i >= len(spots) || ticket == 0 {
			continue
		}
		l := spots[i].line
		parked++
		lastTail[l.key] = max(lastTail[l.key], ticket+l.interval)
		p.booker.metrics.decisions.WithLabelValues(l.gate, "deferred").Inc()
		p.booker.metrics.throttled.WithLabelValues(queue, "parked").Inc()
	}
	for key, tail := range lastTail {
		p.booker.lines.note(key, tail, p.clock.Now())
	}
	return parked, read, next, nil
}

// lineOf is the line task id (message m) of queue is parked in: the
// furthest of its gates' lines, if one reaches further than a worker holds
// a task for. tails holds the tails read for this batch.
func (p *parker) lineOf(ctx context.Context, gs *gateSet, queue, id string, m taskMessage, now time.Time, tails map[string]int64) (backlogLine, bool) {
	r := gs.routeOf(queue, m.typ)
	if len(r.gates) == 0 {
		return backlogLine{}, false
	}
	claims := r.claims
	if r.keyed {
		vars := newTaskVars(queue, id, m.typ, m.payload)
		vars.client = m.headers[HeaderClient]
		var ok bool
		if claims, ok = p.booker.claimsOf(r, vars); !ok {
			return backlogLine{}, false
		}
	}
	limitersNow := p.booker.lines.limitersNow(now)
	var best backlogLine
	bestTail := limitersNow + alwaysHold.Microseconds()
	for _, c := range claims {
		l, ok := lineOf(queue, c, r.cost)
		if !ok {
			continue
		}
		tail, read := tails[l.key]
		if !read {
			t, err := p.booker.readLines(ctx, []string{l.key}, now)
			if err != nil {
				return backlogLine{}, false
			}
			tail, tails[l.key] = t[0], t[0]
		}
		if tail > bestTail {
			best, bestTail = l, tail
		}
	}
	return best, best.key != ""
}

// oneServer reports whether the limits' client a and asynq's b reach one
// server (or one cluster), as a worker's do (both from its config's redis):
// the parker's one script writes the queue's keys and its lines together.
// A Scheduler whose limits live elsewhere than its queues (tests do that)
// does not park.
func oneServer(a, b redis.UniversalClient) bool {
	switch a := a.(type) {
	case *redis.Client:
		b, ok := b.(*redis.Client)
		return ok && a.Options().Addr == b.Options().Addr && a.Options().DB == b.Options().DB
	case *redis.ClusterClient:
		b, ok := b.(*redis.ClusterClient)
		return ok && slices.Equal(a.Options().Addrs, b.Options().Addrs)
	}
	return false
}

// parkClaim is held by the worker parking queue's backlog.
func parkClaim(queue string) string { return throttle.Key("sluice:park:", queue) }

// taskMessage is what the parker reads of a pending task's asynq message
// (asynq's internal TaskMessage, a protobuf message: type 1, payload 2,
// retried 6, error_msg 7, headers 15). TestParkReadsAsynqMessages pins the
// fields against the asynq of go.mod.
type taskMessage struct {
	typ     string
	payload []byte
	retried int64
	lastErr string
	headers map[string]string
}

// fresh: the task comes from its producer, never back from waiting for a
// turn or from a failure: one back holds a turn or a ticket already.
func (m taskMessage) fresh() bool {
	return m.retried == 0 && m.lastErr == "" && m.headers[headerOrigin] == ""
}

// decodeTaskMessage reads b; ok is false if it is not a message asynq
// wrote.
func decodeTaskMessage(b []byte) (m taskMessage, ok bool) {
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return m, false
		}
		b = b[n:]
		switch {
		case typ == protowire.BytesType && (num == 1 || num == 2 || num == 7 || num == 15):
			v, n := protowire.ConsumeBytes(b)
			if n < 0 {
				return m, false
			}
			switch num {
			case 1:
				m.typ = string(v)
			case 2:
				m.payload = v
			case 7:
				m.lastErr = string(v)
			case 15:
				k, val, ok := decodeHeader(v)
				if !ok {
					return m, false
				}
				if m.headers == nil {
					m.headers = map[string]string{}
				}
				m.headers[k] = val
			}
			b = b[n:]
		case typ == protowire.VarintType && num == 6:
			v, n := protowire.ConsumeVarint(b)
			if n < 0 {
				return m, false
			}
			m.retried = int64(int32(v))
			b = b[n:]
		default:
			n := protowire.ConsumeFieldValue(num, typ, b)
			if n < 0 {
				return m, false
			}
			b = b[n:]
		}
	}
	return m, m.typ != ""
}

// decodeHeader reads one entry of a protobuf map<string, string>: key 1,
// value 2.
func decodeHeader(b []byte) (key, val string, ok bool) {
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 || typ != protowire.BytesType {
			return "", "", false
		}
		b = b[n:]
		v, n := protowire.ConsumeBytes(b)
		if n < 0 {
			return "", "", false
		}
		switch num {
		case 1:
			key = string(v)
		case 2:
			val = string(v)
		}
		b = b[n:]
	}
	return key, val, true
}
