package jobs

import (
	"context"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
	"google.golang.org/protobuf/encoding/protowire"

	"github.com/sluicehq/sluice/lua"
	"github.com/sluicehq/sluice/throttle"
)

// A backlog is parked, not taken task by task. A task queued behind others
// that must wait in Redis for its turn is taken by a worker, booked, and
// sent back through asynq's retry: three script runs (asynq's dequeue, the
// booking, asynq's retry) before the visit that runs it. Once a worker has
// sent back a fresh task (new from its producer), its parker books the
// tasks queued behind it from the head of the queue, as a worker would
// (a turn ahead, or a ticket in its gate's backlog line: booking.go,
// backlog.go), several at once, and moves a batch of them to wait in Redis
// in one script run (lua/park.lua): each noted in the wake set, resting in
// asynq's retry set as a task sent back would, and back near its turn. A
// task is parked only if it is fresh, has a retry left and has a rate gate;
// any other is left for the workers, so a task of another type is not held
// up by the backlog before it, and parking stops at a task whose turn has
// come (the gates have room: its turn is given back and the workers take
// it). A queue with fair shares is never parked: its tasks wait in their
// keys' lines (fair.go).
//
// One worker at a time parks a queue (a claim in Redis, parkLease); a task
// a worker takes meanwhile finds the turn booked for it under its booking
// ID.
const (
	// parkBatch is how many tasks one script run parks at most: the
	// workers take some of the backlog's head too while the parker books a
	// batch, and those go the long way.
	parkBatch = 1024
	// parkBytes bounds what a batch reads of its tasks' messages: a batch
	// is smaller where they are large (the first has parkFirst, none fewer
	// than parkLeast).
	parkBytes = 4 << 20
	parkFirst = 64
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

	// The fresh tasks leave the pending list first, in one script run, so
	// that no worker takes one while it books; they rest in asynq's retry
	// set meanwhile, due back after parkHold should this worker die before
	// it notes them.
	args := []any{prefix + "t:", parkHold.Seconds(), parkedMark}
	var candidates []int
	decoded := make([]taskMessage, len(ids))
	for i, id := range ids {
		m, ok := decodeTaskMessage([]byte(msgs[i].Val()))
		if !ok || !m.fresh() || m.retried >= m.retry || len(gs.routeOf(queue, m.typ).gates) == 0 {
			continue // back from waiting or failing, no retry left, or no gate: for the workers
		}
		decoded[i] = m
		candidates = append(candidates, i)
		args = append(args, id)
	}
	if len(candidates) == 0 {
		return 0, read, next, nil
	}
	moved, err := parkScript.Run(ctx, p.queues, []string{prefix + "pending", prefix + "retry"}, args...).Int64Slice()
	if err != nil {
		return 0, read, next, err
	}

	// Each moved task books as a worker would book it (booking.go),
	// parkBookings at a time: a turn ahead (kept under its booking ID), or
	// a ticket in its gate's line; either way it is due back before it. A
	// turn it could take now means the gates have room: it is given back,
	// the task is due back at once, and the workers take the rest.
	// The first books alone: a turn given back is exact only if no later
	// one was booked meanwhile, and the first is the one to find room.
	spots := make([]parkSpot, len(ids))
	var room atomic.Bool
	var wg sync.WaitGroup
	sem := make(chan struct{}, parkBookings)
	for j, i := range candidates {
		if j >= len(moved) || moved[j] != 1 {
			continue // a worker took it
		}
		parked++
		if room.Load() {
			spots[i] = parkSpot{due: p.booker.lines.limitersNow(p.clock.Now())} // back at once, for the workers
			continue
		}
		book := func() {
			var ok bool
			if spots[i], ok = p.book(ctx, gs, queue, ids[i], decoded[i]); !ok {
				room.Store(true)
			}
		}
		if parked == 1 {
			book()
			continue
		}
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			book()
		})
	}
	wg.Wait()
	pipe = p.queues.Pipeline()
	for i, spot := range spots {
		if spot.due == 0 {
			continue
		}
		if !spot.noted {
			pipe.ZAdd(ctx, wakeKeys(queue)[0], redis.Z{Score: float64(spot.due), Member: ids[i]})
		}
		// asynq's own fallback, a second or two after the task is due.
		pipe.ZAddXX(ctx, prefix+"retry", redis.Z{Score: float64((spot.due+requeueLead.Microseconds())/1_000_000 + 2), Member: ids[i]})
	}
	if _, err := pipe.Exec(ctx); err != nil {
		return parked, read, next, err
	}
	p.booker.metrics.throttled.WithLabelValues(queue, "parked").Add(float64(parked))
	if room.Load() {
		return parked, 0, next, nil // the workers take the rest
	}
	return parked, read, next, nil
}

// parkHold is how long a parked task rests in asynq's retry set before
// its booking notes when it is due: asynq brings it back after it if the
// parking worker died in between.
const parkHold = 10 * time.Second

// parkBookings is how many bookings a parker makes at once (throttle
// pipelines them).
const parkBookings = 64

// parkSpot is when a parked task is due back, in µs on the limiters'
// clock (0: not parked), and whether its booking noted it in the wake set
// already.
type parkSpot struct {
	due   int64
	noted bool
}

// book books task id of queue (message m) as a worker would, with no room
// to hold it, and returns when it is due back. ok is false if its turn has
// come: it is given back, and the task is due back at once.
func (p *parker) book(ctx context.Context, gs *gateSet, queue, id string, m taskMessage) (parkSpot, bool) {
	t := asynq.NewTaskWithHeaders(m.typ, m.payload, m.headers)
	task := taskRef{t: t, queue: queue, id: id, booking: bookingID(queue, id, t), fresh: true}
	now := p.booker.lines.limitersNow(p.clock.Now())
	o, err := p.booker.book(ctx, gs, task, false)
	if err != nil {
		return parkSpot{due: now + redisRetry.Microseconds()}, true
	}
	switch o := o.(type) {
	case turnAhead:
		return parkSpot{due: o.at.Add(-requeueLead).UnixMicro()}, true
	case notedIn:
		return parkSpot{due: now + o.d.Microseconds(), noted: true}, true
	case askAgainIn:
		return parkSpot{due: now + o.d.Microseconds()}, true
	case runNow:
		p.booker.giveBack(ctx, o.turns)
	}
	return parkSpot{due: now}, false
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
// retry 5, retried 6, error_msg 7, headers 15). TestParkReadsAsynqMessages pins the
// fields against the asynq of go.mod.
type taskMessage struct {
	typ     string
	payload []byte
	retry   int64 // retries allowed
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
		case typ == protowire.VarintType && (num == 5 || num == 6):
			v, n := protowire.ConsumeVarint(b)
			if n < 0 {
				return m, false
			}
			if num == 5 {
				m.retry = int64(int32(v))
			} else {
				m.retried = int64(int32(v))
			}
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
