package jobs

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"maps"
	"slices"
	"strings"
	"sync"
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
// sent back a fresh task (new from its producer), its parker takes the tasks
// queued behind it off the head of the queue, a batch per script run
// (lua/park.lua), so that no worker takes them one by one, books each as a
// worker would (a turn ahead, or a ticket in its gate's backlog line:
// booking.go, backlog.go) and notes it in the wake set: it rests in asynq's
// retry set as a task sent back would, and is back near its turn. A task
// is parked only if it is fresh and has a rate gate (one with no retry left
// too: it is moved, not retried by asynq); any other is left for the
// workers, so a task of another kind is not held up by the backlog before
// it, and a queue whose booking finds its turn has come (the gates have
// room) is left to the workers. A queue with fair shares is never parked:
// its tasks wait in their keys' lines (fair.go).
//
// One worker of the fleet parks at a time (a claim in Redis, parkLease),
// every backlogged queue together: their tasks book one at a time, each
// queue's in the order they were queued, the queues in turn by priority,
// so that queues sharing a quota share it as the workers would.
const (
	// parkBatch is how many tasks one script run takes off a queue at
	// most.
	parkBatch = 1024
	// parkBytes bounds what a batch reads of its tasks' messages: a batch
	// is smaller where they are large (none has fewer than parkLeast but
	// a queue's first, one task).
	parkBytes = 4 << 20
	parkLeast = 8
	// parkLease is the life of the fleet's parking claim, renewed while
	// it parks.
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

// parker parks the backlogs of the queues whose fresh tasks its worker
// sent back to Redis (and of the others backlogged then).
type parker struct {
	fleetDeps
	booker *booker

	mu      sync.Mutex
	asked   map[string]bool // queues to look at
	booking time.Duration   // how long a booking takes, lately
	// handed: this worker handed tasks to the parker (toParker) since it
	// last parked: if another worker parks, this one tries again soon,
	// for that one may be done before it sees them.
	handed bool
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

// askHanded has the parker look at queue, whose task this worker handed
// to it (Scheduler.handToParker).
func (p *parker) askHanded(queue string) {
	p.mu.Lock()
	p.handed = true
	p.mu.Unlock()
	p.ask(queue)
}

func (p *parker) run(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-p.signal:
		}
		if parked := p.parkBacklogs(ctx); !parked && p.stillHanded() {
			// Another worker parks: it looks at the handed lists once a
			// second while it does, and this one claims the parking
			// itself once that one is done.
			time.AfterFunc(handedRetry, func() {
				select {
				case p.signal <- struct{}{}:
				default:
				}
			})
		}
	}
}

// stillHanded reports whether this worker handed tasks to the parker that
// it has not parked since.
func (p *parker) stillHanded() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.handed
}

const (
	// handedRetry is how soon a worker that handed tasks to the parker
	// tries to park again when another worker was parking.
	handedRetry = 500 * time.Millisecond
	// handedLook is how often a parking looks for tasks handed over for
	// the queues it parks.
	handedLook = 20 * time.Millisecond
	// handedLife: a queue's handed list is kept this long after its last
	// task was put on it (its tasks come back by themselves after
	// parkHold).
	handedLife = time.Minute
)

// takeAsked returns the queues asked for since the last call.
func (p *parker) takeAsked() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	queues := make([]string, 0, len(p.asked))
	for q := range p.asked {
		queues = append(queues, q)
	}
	clear(p.asked)
	slices.Sort(queues)
	return queues
}

// backlog is one queue's part of a parking: the tasks taken off its
// pending list and not booked yet, and its turn in the round robin.
type backlog struct {
	queue   string
	weight  int
	current int          // smooth weighted round robin
	size    int          // how many tasks the next take reads
	moved   []parkedTask // taken, to book in order
	booked  int
	// sentBack: a fresh task of the queue was sent back to Redis (its gates
	// are booked ahead): no probe.
	sentBack bool
	drained  bool // its head has no more tasks to take
	done     bool
	// quotas: those the tasks it took draw on (by gate name), which it
	// may share with other queues' backlogs.
	quotas map[string]bool
	// ahead: a task of it booked a turn ahead (its gates are booked
	// ahead); handed: its probe's turn had come, and it was left to the
	// workers.
	ahead, handed bool
	// line: the backlog line its last task took a ticket in; turns: its
	// last task booked a turn ahead; claims: what that task claimed
	// (claimsKey). The tasks after it that claim the same take the next
	// tickets of that line together (ticketRun), or book their turns
	// together (seriesRun).
	line   *backlogLine
	turns  bool
	claims string
	gates  *gateSet // the limits in force then: a change ends the run
	// roomy: how many of its last bookings in a row found their turn had
	// come.
	roomy int
}

// mayShare reports whether backlogs a and b may share a quota: one that
// has taken nothing yet may.
func mayShare(a, b *backlog) bool {
	if len(a.quotas) == 0 || len(b.quotas) == 0 {
		return true
	}
	for q := range a.quotas {
		if b.quotas[q] {
			return true
		}
	}
	return false
}

// sharesWithBulk reports whether backlog b may share a quota with another
// backlog the parker books in bulk (one whose tasks were sent back, past
// its probe, or whose probe found its gates booked ahead).
func sharesWithBulk(backlogs []*backlog, b *backlog) bool {
	return slices.ContainsFunc(backlogs, func(o *backlog) bool {
		return o != b && !o.done && (o.sentBack || o.booked >= 2 || o.ahead) && mayShare(o, b)
	})
}

// sharesWithAny reports whether backlog b may share a quota with another
// backlog of the parking not done yet.
func sharesWithAny(backlogs []*backlog, b *backlog) bool {
	return slices.ContainsFunc(backlogs, func(o *backlog) bool { return o != b && !o.done && mayShare(o, b) })
}

// handedSharing takes back the queues left to the workers that may share
// a quota with b, whose gates were just found booked ahead: the workers
// would get only the turns the parker does not book ahead for b.
func handedSharing(backlogs []*backlog, b *backlog) []string {
	var queues []string
	for _, o := range backlogs {
		if o.handed && mayShare(o, b) {
			o.handed = false
			queues = append(queues, o.queue)
		}
	}
	return queues
}

type parkedTask struct {
	id string
	m  taskMessage
	// handed: a worker handed it over (toParker), its throttling counted
	// by that worker's refused booking: it books alone, counted again
	// only if refused (a series or a run of tickets counts each task).
	handed bool
}

// parkBacklogs parks the backlogs of the queues asked for (and of any
// asked meanwhile), one worker of the fleet at a time. Their tasks book one
// at a time, the queues in turn by their priority (smooth weighted round
// robin, as asynq's workers take them on average), so that queues sharing
// a quota share it as the workers would have shared it, and each queue's
// tasks book in the order they were queued.
func (p *parker) parkBacklogs(ctx context.Context) (parked bool) {
	claim := parkClaim(p.gates().cfg.Queues)
	ok, err := p.rdb.SetNX(ctx, claim, p.worker, parkLease).Result()
	if err != nil && ctx.Err() == nil {
		if d, _ := p.booker.logGate.AllowN(context.Background(), claim, 1); d.Allowed {
			p.log.Warn("cannot park a backlog: its workers take the tasks one by one, 3 script runs each (may the Redis user write sluice:park:*?; further failures in the next 10s are not logged)", "claim", claim, "err", err)
		}
	}
	if err != nil || !ok {
		return false // another worker parks: it is asked by its own tasks
	}
	p.mu.Lock()
	p.handed = false // what was handed is on the lists this parking reads
	p.mu.Unlock()
	defer p.rdb.Del(context.WithoutCancel(ctx), claim)
	var notes parkNotes
	defer p.writeNotes(context.WithoutCancel(ctx), &notes)
	renewed := p.clock.Now()
	var backlogs []*backlog
	// A queue whose fresh task was sent back has its gates booked ahead:
	// it is taken in bulk at once. Any other is probed with one task first.
	join := func(gs *gateSet, queues []string, asked bool) {
		for _, q := range queues {
			if slices.ContainsFunc(backlogs, func(b *backlog) bool { return b.queue == q && !b.done }) || gs.fair[q] != nil {
				continue
			}
			b := &backlog{queue: q, weight: max(1, gs.cfg.Queues[q].Priority), size: 1}
			if asked {
				b.size, b.sentBack = parkBatch, true
			}
			backlogs = append(backlogs, b)
		}
	}
	// Every queue with tasks pending joins from the start, not only those
	// whose tasks were sent back: queues that share a quota book on it in
	// turn from its first booking on.
	// A queue whose tasks were handed over (toParker) has its gates booked
	// ahead too: in bulk. One done already, or whose head is drained,
	// takes them.
	joinHanded := func(gs *gateSet, queues []string) {
		for _, b := range backlogs {
			if !b.done && slices.Contains(queues, b.queue) {
				b.drained = false
			}
		}
		join(gs, queues, true)
	}
	gs := p.gates()
	join(gs, p.takeAsked(), true)
	pending, handed := p.backlogged(ctx)
	joinHanded(gs, handed)
	join(gs, pending, false)
	looked, lookedHanded := p.clock.Now(), p.clock.Now()
	for count := 0; count < parkMost; {
		if now := p.clock.Now(); now.Sub(renewed) > parkLease/3 {
			p.rdb.PExpire(ctx, claim, parkLease)
			renewed = now
		}
		gs := p.gates()
		join(gs, p.takeAsked(), true)
		if now := p.clock.Now(); now.Sub(looked) > time.Second {
			pending, handed := p.backlogged(ctx) // queues backlogged since
			joinHanded(gs, handed)
			join(gs, pending, false)
			looked, lookedHanded = now, now
		} else if now.Sub(lookedHanded) > handedLook {
			// The tasks a worker was booking as this parking took its
			// queue's pending list are handed over a moment later: they
			// go before the queue's tasks not booked yet.
			p.lookHanded(ctx, backlogs)
			lookedHanded = now
		}
		b := pickBacklog(backlogs)
		if b == nil {
			// Tasks handed over since the last look are parked before the
			// claim goes, if any queue they were handed for can be parked
			// (not one with fair shares since a live change: its list
			// lapses by itself).
			_, handed := p.backlogged(ctx)
			joined := len(backlogs)
			joinHanded(gs, handed)
			if len(backlogs) == joined {
				return true
			}
			looked = p.clock.Now()
			continue
		}
		// Taken ahead of the bookings, so that the workers, finding the
		// queue's head empty, do not take its tasks one by one meanwhile;
		// but one task alone first where none was sent back, whose booking
		// may find the gates have room (the queue is then the workers').
		for !b.drained && len(b.moved) < parkAhead && (b.booked > 0 || b.sentBack || len(b.moved) == 0) {
			// Tasks handed over were taken off the queue's head before
			// anything its pending list holds now: they book first.
			if handed := p.takeHanded(ctx, gs, b); len(handed) > 0 {
				b.moved = append(handed, b.moved...)
				b.sentBack = true
			}
			moved, err := p.take(ctx, gs, b)
			if err != nil && ctx.Err() == nil {
				p.log.Warn("cannot park a queue's backlog; its workers take the tasks one by one", "queue", b.queue, "err", err)
			}
			b.moved = append(b.moved, moved...)
			b.drained = err != nil || len(moved) == 0
		}
		if len(b.moved) == 0 {
			b.done = true
			continue
		}
		if (b.line != nil || b.turns) && b.gates == gs && !sharesWithAny(backlogs, b) {
			run := p.ticketRun
			if b.line == nil {
				run = p.seriesRun
			}
			if n := run(ctx, gs, b, &notes); n > 0 {
				count += n
				b.booked += n
				continue
			}
		}
		t := b.moved[0]
		b.moved = b.moved[1:]
		// A task whose turn has come keeps it, and its queue stays in the
		// round robin, where another queue's backlog booked in bulk may
		// share a quota with it (a probe) or any other may (a task booked
		// in bulk): handed to the workers, who book a task as they take
		// it, it would get only the turns of the quota the parker had not
		// booked ahead for the other (a queue's share would follow who
		// books first, not its priority).
		keep := sharesWithAny(backlogs, b)
		if b.booked == 0 && !b.sentBack {
			keep = sharesWithBulk(backlogs, b)
		}
		began := time.Now()
		spot, ok := p.book(ctx, gs, b.queue, t, keep)
		p.booked(time.Since(began))
		p.note(ctx, &notes, b.queue, t.id, spot, spot.now)
		count++
		b.booked++
		b.line, b.turns, b.claims, b.gates = spot.line, ok && spot.ahead && spot.line == nil && !keep, "", gs
		if b.line != nil || b.turns {
			b.claims = p.claimsKey(gs, b.queue, t)
		}
		if spot.ahead && !b.ahead {
			b.ahead = true
			join(gs, handedSharing(backlogs, b), true)
		}
		if ok {
			b.roomy = 0
		} else {
			b.roomy++
		}
		if !ok && (b.booked == 1 || b.roomy >= 2) {
			// Its turn had come: the gates have room (at its first
			// booking, or at two in a row: the turns booked ahead are
			// past), the rest of what was taken is due back at once, and
			// the workers take the queue's tasks as they book. Booked on,
			// each would find the turn given back again; kept requeueLead
			// ahead, a turn is lost whenever the workers, busy, take its
			// task after it. One turn come alone, in the middle of turns
			// booked ahead or of a line, is a gap: the task alone is due
			// back at once (handing the queue back there sent a 10,000
			// deep backlog through the workers one by one, 3 script runs a
			// task).
			now := p.booker.lines.limitersNow(p.clock.Now())
			for _, t := range b.moved {
				p.note(ctx, &notes, b.queue, t.id, parkSpot{due: now}, now)
			}
			b.moved, b.done, b.handed = nil, true, true
		}
	}
	return true
}

// ticketRun gives the tasks at the head of b's taken tasks that claim
// what its last task claimed, which took a ticket in a backlog line, the
// next tickets of that line, up to parkTicketRun of them in one step (two
// pipelines, whatever their number), with no booking each: while the line
// reaches further than a worker holds a task for, a fresh task's booking
// finds a turn only in a gap the line's tasks left, which the tasks back
// for their tickets fill as well (each books the earliest turn). It
// returns how many took tickets: none if the head claims otherwise (it
// books, as the first of a run does).
func (p *parker) ticketRun(ctx context.Context, gs *gateSet, b *backlog, notes *parkNotes) int {
	n := 0
	for n < len(b.moved) && n < parkTicketRun && b.claims != "" && !b.moved[n].handed && p.claimsKey(gs, b.queue, b.moved[n]) == b.claims {
		n++
	}
	if n == 0 {
		b.line = nil
		return 0
	}
	ids := make([]string, n)
	for i, t := range b.moved[:n] {
		ids[i] = t.id
	}
	now := p.booker.lines.limitersNow(p.clock.Now())
	tickets, err := p.booker.takeTickets(ctx, b.queue, *b.line, 0, now, ids, n)
	if err != nil {
		b.line = nil // they book one by one
		return 0
	}
	// Throttled by the line's gate, which did not count them (no booking
	// did): counted once, here; their bookings at their tickets count only
	// refusals (bookTurn).
	if c := b.line.claim; c.lim != nil {
		if err := throttle.NoteThrottled(ctx, c.lim, c.key, n*b.line.cost); err != nil {
			p.log.Warn("cannot count tasks given tickets in the key's recent throttles; enqueue status --keys shows fewer", "queue", b.queue, "gate", b.line.gate, "err", err)
		}
	}
	for i, ticket := range tickets {
		p.note(ctx, notes, b.queue, ids[i], parkSpot{due: ticket - requeueLead.Microseconds(), noted: true, ahead: true, now: now}, now)
	}
	b.moved = b.moved[n:]
	return n
}

// parkTicketRun bounds the tickets one ticketRun takes.
const parkTicketRun = 256

// seriesRun books the turns of the tasks at the head of b's taken tasks
// that claim what its last task claimed, which booked a turn ahead, in one
// script run (throttle.BookSeries: per task only the SET of its turn kept
// under its booking ID, where a booking each is 6 to 8 commands), each
// the turn its own booking would have given it, and notes them in the wake
// set in the same run. It stops at a turn beyond worker.reserve_max or one
// that has come (the next task books alone, as the first of a run does),
// and returns how many it booked: none if the head claims otherwise, a
// backlog line of its gates is active (its tasks book only turns they
// would hold for), or Redis failed.
func (p *parker) seriesRun(ctx context.Context, gs *gateSet, b *backlog, notes *parkNotes) int {
	n := 0
	for n < len(b.moved) && n < parkSeriesRun && b.claims != "" && !b.moved[n].handed && p.claimsKey(gs, b.queue, b.moved[n]) == b.claims {
		n++
	}
	b.turns = false // the next task books alone unless this run books all n
	if n == 0 {
		return 0
	}
	head := b.moved[0]
	r := gs.routeOf(b.queue, head.m.typ)
	claims := r.claims
	if r.keyed {
		var ok bool
		if claims, ok = p.booker.claimsOf(r, varsOf(b.queue, head.id, asynq.NewTaskWithHeaders(head.m.typ, head.m.payload, head.m.headers))); !ok {
			return 0
		}
	}
	if _, active := p.booker.activeLine(ctx, b.queue, claims, r.cost); active {
		return 0
	}
	reserveMax := gs.cfg.Worker.ReserveMax
	if r.adaptive {
		reserveMax = min(reserveMax, adaptiveReserve)
	}
	bookClaims := make([]throttle.Claim, len(claims))
	for i, c := range claims {
		bookClaims[i] = throttle.Claim{Limiter: c.lim, Key: c.key, N: r.cost}
	}
	ids, members := make([]string, n), make([]string, n)
	for i, t := range b.moved[:n] {
		ids[i] = bookingID(b.queue, t.id, asynq.NewTaskWithHeaders(t.m.typ, t.m.payload, t.m.headers))
		members[i] = t.id
	}
	start := time.Now()
	booked, err := throttle.BookSeries(ctx, bookClaims, ids, time.Time{}, time.Microsecond, reserveMax,
		throttle.MaxLate(lateTolerance), throttle.RemindEach(wakeKeys(b.queue)[0], members, requeueLead, 0))
	p.booked(time.Since(start) / time.Duration(max(len(booked), 1)))
	if err != nil || len(booked) == 0 {
		return 0 // they book one by one
	}
	m := p.booker.metrics
	m.bookings.WithLabelValues(b.queue).Inc()
	for i, c := range claims {
		m.evaluations.WithLabelValues(c.g.name).Inc()
		m.scriptSeconds.WithLabelValues(c.g.name).Observe(time.Since(start).Seconds())
		m.decisions.WithLabelValues(c.g.name, "reserved").Add(float64(len(booked)))
		if c.g.expr == nil && c.g.limit.Limit > 0 {
			m.remaining.WithLabelValues(c.g.name).Set(float64(booked[len(booked)-1].Turns[i].Remaining))
		}
	}
	now := booked[0].At.Add(-booked[0].Delay).UnixMicro()
	for i, bk := range booked {
		m.turnWait.WithLabelValues(b.queue).Observe(bk.Delay.Seconds())
		p.note(ctx, notes, b.queue, members[i], parkSpot{due: bk.At.Add(-requeueLead).UnixMicro(), noted: bk.Reminded, ahead: true, now: now}, now)
	}
	b.moved = b.moved[len(booked):]
	b.turns = len(booked) == n
	return len(booked)
}

// parkSeriesRun bounds the turns one seriesRun books: one script run holds
// its Redis server while it books them.
const parkSeriesRun = 256

// claimsKey names the claims task t of queue makes on its gates (its type,
// and the key value of each keyed gate); "" if they are not known without
// a booking (its key failed).
func (p *parker) claimsKey(gs *gateSet, queue string, t parkedTask) string {
	r := gs.routeOf(queue, t.m.typ)
	if r.fair || len(r.gates) == 0 {
		return ""
	}
	if !r.keyed {
		return t.m.typ
	}
	claims, ok := p.booker.claimsOf(r, varsOf(queue, t.id, asynq.NewTaskWithHeaders(t.m.typ, t.m.payload, t.m.headers)))
	if !ok {
		return ""
	}
	var key strings.Builder
	key.WriteString(t.m.typ)
	for _, c := range claims {
		key.WriteByte(0)
		key.WriteString(c.key)
	}
	return key.String()
}

// parkAhead is how many tasks of a queue a parker takes ahead of its
// bookings, at most: the workers take one by one what it leaves pending
// while it books (a task is about a millisecond's booking), and each of
// them costs three script runs where a parked one costs one.
const parkAhead = 1 << 17

// backlogged lists the queues of the config in force with tasks pending,
// and those with tasks handed to the parker (toParker).
func (p *parker) backlogged(ctx context.Context) (pending, handed []string) {
	queues := slices.Sorted(maps.Keys(p.gates().cfg.Queues))
	pipe := p.queues.Pipeline()
	lens := make([]*redis.IntCmd, len(queues))
	handedLens := make([]*redis.IntCmd, len(queues))
	for i, q := range queues {
		lens[i] = pipe.LLen(ctx, asynqKeys(q)+"pending")
		if len(queues) > 1 { // none is handed over where one queue is all
			handedLens[i] = pipe.LLen(ctx, handedKey(q))
		}
	}
	if _, err := pipe.Exec(ctx); err != nil {
		return nil, nil
	}
	for i, q := range queues {
		if lens[i].Val() > 0 {
			pending = append(pending, q)
		}
		if handedLens[i] != nil && handedLens[i].Val() > 0 {
			handed = append(handed, q)
		}
	}
	return pending, handed
}

// lookHanded has each backlog of a parking take the tasks handed over for
// its queue since it last took (takeHanded), however drained its queue's
// pending list: one LLEN each, in one round trip.
func (p *parker) lookHanded(ctx context.Context, backlogs []*backlog) {
	if len(p.gates().cfg.Queues) < 2 {
		return
	}
	pipe := p.queues.Pipeline()
	lens := map[*backlog]*redis.IntCmd{}
	for _, b := range backlogs {
		if !b.done && b.drained {
			lens[b] = pipe.LLen(ctx, handedKey(b.queue))
		}
	}
	if len(lens) == 0 {
		return
	}
	if _, err := pipe.Exec(ctx); err != nil {
		return // the look of the next second sees them
	}
	for b, n := range lens {
		if n.Val() > 0 {
			b.drained = false
		}
	}
}

// takeHanded takes the tasks workers handed over for b's queue (toParker),
// up to parkBatch, the first handed first. A task is taken while asynq
// has it active (its worker is sending it back), in its retry set (sent
// back) or scheduled (a copy, for one with no retry left); one back since,
// done or deleted is left alone.
func (p *parker) takeHanded(ctx context.Context, gs *gateSet, b *backlog) []parkedTask {
	if len(gs.cfg.Queues) < 2 {
		return nil
	}
	ids, err := p.queues.LPopCount(ctx, handedKey(b.queue), parkBatch).Result()
	if err != nil || len(ids) == 0 {
		if err != nil && err != redis.Nil && ctx.Err() == nil {
			p.log.Warn("cannot read the tasks handed to the parker; asynq brings them back after parkHold", "queue", b.queue, "err", err)
		}
		return nil
	}
	prefix := asynqKeys(b.queue)
	pipe := p.queues.Pipeline()
	fields := make([]*redis.SliceCmd, len(ids))
	for i, id := range ids {
		fields[i] = pipe.HMGet(ctx, prefix+"t:"+id, "msg", "state")
	}
	if _, err := pipe.Exec(ctx); err != nil {
		if ctx.Err() == nil {
			p.log.Warn("cannot read the tasks handed to the parker; asynq brings them back after parkHold", "queue", b.queue, "err", err)
		}
		return nil
	}
	var taken []parkedTask
	for i, id := range ids {
		msg, _ := fields[i].Val()[0].(string)
		state, _ := fields[i].Val()[1].(string)
		if state != "active" && state != "retry" && state != "scheduled" {
			continue
		}
		// As its worker handed it: fresh but for the wait's message (or a
		// copy of it, unbooked: one with no retry left).
		m, ok := decodeTaskMessage([]byte(msg))
		if !ok || m.retried != 0 || len(gs.routeOf(b.queue, m.typ).gates) == 0 {
			continue // not as it was handed: asynq brings it back
		}
		if !gs.routeOf(b.queue, m.typ).keyed {
			m.payload = nil // not read to book it
		}
		taken = append(taken, parkedTask{id: id, m: m, handed: true})
		if b.quotas == nil {
			b.quotas = map[string]bool{}
		}
		for _, g := range gs.routeOf(b.queue, m.typ).quotas {
			b.quotas[g.name] = true
		}
	}
	return taken // counted throttled as its worker handed it over
}

// parkMost bounds the tasks one parking books (the next fresh task sent
// back asks again).
const parkMost = 1 << 20

// pickBacklog is the next backlog in the smooth weighted round robin of
// those not done, or nil.
func pickBacklog(backlogs []*backlog) *backlog {
	var best *backlog
	total := 0
	for _, b := range backlogs {
		if b.done {
			continue
		}
		b.current += b.weight
		total += b.weight
		if best == nil || b.current > best.current {
			best = b
		}
	}
	if best != nil {
		best.current -= total
	}
	return best
}

// take takes up to b.size fresh tasks with a rate gate off the head of b's queue, in one script run, so that no worker takes
// one while it books: they rest in asynq's retry set meanwhile, due back
// after parkHold should this worker die before it notes them. A task of
// another kind at the head is left for the workers.
func (p *parker) take(ctx context.Context, gs *gateSet, b *backlog) ([]parkedTask, error) {
	prefix := asynqKeys(b.queue)
	ids, err := p.queues.LRange(ctx, prefix+"pending", int64(-b.size), -1).Result()
	if err != nil || len(ids) == 0 {
		return nil, err
	}
	slices.Reverse(ids) // the head (asynq takes the right end) first
	pipe := p.queues.Pipeline()
	msgs := make([]*redis.StringCmd, len(ids))
	for i, id := range ids {
		msgs[i] = pipe.HGet(ctx, prefix+"t:"+id, "msg")
	}
	if _, err := pipe.Exec(ctx); err != nil && err != redis.Nil {
		return nil, err
	}
	bytes := 0
	for _, m := range msgs {
		bytes += len(m.Val())
	}
	b.size = min(parkBatch, max(parkLeast, len(ids)*parkBytes/max(bytes, 1)))
	// asynq's own fallback for the n-th task taken ahead: a while after
	// the parker should have booked it.
	pace := p.pace()
	fallback := parkHold + time.Duration(len(b.moved))*pace
	args := []any{prefix + "t:", fallback.Microseconds(), parkedMark, pace.Microseconds()}
	var candidates []parkedTask
	for i, id := range ids {
		m, ok := decodeTaskMessage([]byte(msgs[i].Val()))
		if !ok || !m.fresh() {
			continue // back from waiting or failing: for the workers
		}
		r := gs.routeOf(b.queue, m.typ)
		if len(r.gates) == 0 {
			continue // no gate: for the workers
		}
		if !r.keyed {
			m.payload = nil // not read to book it: not held while it waits
		}
		candidates = append(candidates, parkedTask{id: id, m: m})
		args = append(args, id)
	}
	if len(candidates) == 0 {
		return nil, nil
	}
	moved, err := parkScript.Run(ctx, p.queues, []string{prefix + "pending", prefix + "retry"}, args...).Int64Slice()
	if err != nil {
		return nil, err
	}
	taken := candidates[:0]
	for i, t := range candidates {
		if i < len(moved) && moved[i] == 1 {
			taken = append(taken, t)
			if b.quotas == nil {
				b.quotas = map[string]bool{}
			}
			for _, g := range gs.routeOf(b.queue, t.m.typ).quotas {
				b.quotas[g.name] = true
			}
		} // else a worker took it
	}
	p.booker.metrics.throttled.WithLabelValues(b.queue, "parked").Add(float64(len(taken)))
	return taken, nil
}

// parkNotes are the notes of parked tasks not written yet, by queue: when
// each is due back (in the wake set, unless its booking noted it) and
// asynq's own schedule of it, a second or two after. They are written a
// batch at a time, one ZADD of each kind per queue, not two commands per
// task: a task rests in asynq's retry set until then, due back after
// parkHold should the parker die first, so a note written a little later
// is no later a turn, but for one due soon: that batch is written at once.
type parkNotes struct {
	queues map[string]*queueNotes
	count  int
	soon   bool // a note is due within parkNoteSoon
}

type queueNotes struct{ wake, retry []redis.Z }

const (
	parkNoteBatch = 256
	parkNoteSoon  = time.Second
)

// note notes task id of queue due back at spot, now being the limiters'
// clock now (µs), and writes the notes if a batch is full or one is due
// soon.
func (p *parker) note(ctx context.Context, notes *parkNotes, queue, id string, spot parkSpot, now int64) {
	if notes.queues == nil {
		notes.queues = map[string]*queueNotes{}
	}
	q := notes.queues[queue]
	if q == nil {
		q = &queueNotes{}
		notes.queues[queue] = q
	}
	if !spot.noted {
		q.wake = append(q.wake, redis.Z{Score: float64(spot.due), Member: id})
	}
	q.retry = append(q.retry, redis.Z{Score: float64((spot.due+requeueLead.Microseconds())/1_000_000 + 2), Member: id})
	notes.count++
	notes.soon = notes.soon || spot.due-now < parkNoteSoon.Microseconds()
	if notes.count >= parkNoteBatch || notes.soon {
		p.writeNotes(ctx, notes)
	}
}

// writeNotes writes the notes taken so far, in one pipeline.
func (p *parker) writeNotes(ctx context.Context, notes *parkNotes) {
	if notes.count == 0 {
		return
	}
	pipe := p.queues.Pipeline()
	for queue, q := range notes.queues {
		if len(q.wake) > 0 {
			pipe.ZAdd(ctx, wakeKeys(queue)[0], q.wake...)
		}
		pipe.ZAddXX(ctx, asynqKeys(queue)+"retry", q.retry...)
	}
	if _, err := pipe.Exec(ctx); err != nil && ctx.Err() == nil {
		p.log.Warn("cannot note when parked tasks are due; asynq brings them back later", "tasks", notes.count, "err", err)
	}
	clear(notes.queues)
	notes.count, notes.soon = 0, false
}

// A task taken ahead rests in asynq's retry set until the parker has
// booked it and noted when it is due; should the parker die first, asynq
// brings it back itself, parkHold after it was taken and later for each
// task taken ahead of it: three times as long as a booking has taken the
// parker lately (at least parkPace), so that asynq does not bring back a
// task the parker is about to book.
const (
	parkHold = 10 * time.Second
	parkPace = 2 * time.Millisecond
)

// pace is how much later than the task before it asynq may bring back a
// task taken ahead.
func (p *parker) pace() time.Duration {
	p.mu.Lock()
	defer p.mu.Unlock()
	return max(parkPace, 3*p.booking)
}

// booked notes that a booking took d (a moving average of the last few).
func (p *parker) booked(d time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.booking += (d - p.booking) / 16
}

// parkSpot is when a parked task is due back, in µs on the limiters'
// clock (0: not parked), whether its booking noted it in the wake set
// already, and whether its turn lies ahead (its gates are booked ahead).
type parkSpot struct {
	due   int64
	noted bool
	ahead bool
	now   int64 // the limiters' clock at the booking, µs
	// line: the task took a ticket in this backlog line.
	line *backlogLine
}

// book books task id of queue (message m) as a worker would, with no room
// to hold it, and returns when it is due back. ok is false if its turn has
// come: the gates have room, the turn is given back, and the task is due
// back at once. Unless keep: then it books its turn no earlier than
// requeueLead from now, and is due back at once holding it, as a task
// sent back is due back requeueLead before its turn (a worker that takes
// it claims the turn kept under its booking ID; due back for a turn that
// had come, it would find the turn passed and book again, a turn lost),
// and ok is true.
func (p *parker) book(ctx context.Context, gs *gateSet, queue string, pt parkedTask, keep bool) (parkSpot, bool) {
	t := asynq.NewTaskWithHeaders(pt.m.typ, pt.m.payload, pt.m.headers)
	task := taskRef{t: t, queue: queue, id: pt.id, booking: bookingID(queue, pt.id, t), fresh: true, parked: true, handed: pt.handed}
	now := p.booker.lines.limitersNow(p.clock.Now())
	if keep {
		task.notBefore = time.UnixMicro(now).Add(requeueLead)
	}
	o, err := p.booker.book(ctx, gs, task, false)
	if err != nil {
		return parkSpot{due: now + redisRetry.Microseconds(), now: now}, true
	}
	switch o := o.(type) {
	case turnAhead:
		// A turn at its earliest is one whose time had come.
		return parkSpot{due: o.at.Add(-requeueLead).UnixMicro(), ahead: o.at.After(task.notBefore), now: now}, true
	case notedIn:
		return parkSpot{due: now + o.d.Microseconds(), noted: true, ahead: true, now: now, line: o.line}, true
	case askAgainIn:
		return parkSpot{due: now + o.d.Microseconds(), ahead: true, now: now}, true
	case runNow:
		p.booker.giveBack(ctx, o.turns)
	}
	return parkSpot{due: now, now: now}, false
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

// parkClaim is held by the worker of the fleet that parks backlogs: the
// fleet of workers serving queues (another fleet on the same Redis, with
// queues of its own, parks its own).
func parkClaim(queues map[string]QueueConfig) string {
	sum := sha256.Sum256([]byte(strings.Join(slices.Sorted(maps.Keys(queues)), "\x00")))
	return "sluice:park:" + hex.EncodeToString(sum[:12])
}

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
