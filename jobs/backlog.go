package jobs

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/throttle"
)

// A backlog behind a gate costs a bounded amount however deep it is. A
// task refused its turn (none within worker.reserve_max: the gate's
// future is booked that far) takes a place in the gate's backlog line: a
// ticket, the instant its turn should come if every task before it takes
// its own, spaced at the gate's rate from the earliest free turn the
// refusal found. It rests in Redis (asynq's retry schedule, noted in the
// wake set) until just before that instant and books then, once, near its
// turn. While a line reaches further than a worker would hold a task for,
// the fresh tasks of its gate book only a turn they would hold for (so a
// task back for a turn it booked gets it, and gaps are filled) and take
// tickets behind the line otherwise: none of them takes a turn the line's
// tasks are due to book. A
// refused task used to ask again about a second later, every second, all
// of them alike, until its turn came: thousands of bookings a second for a
// deep backlog.
//
// A line is one small sorted set per gate (and key value) in the queue's
// cluster slot, next to its wake set: the member "t" scored with the
// instant after the last ticket, on the limiters' clock, in µs. Tickets are
// taken with plain commands (ZADD GT, ZINCRBY): no script run. The
// limiters stay the judge: a ticket is only when to ask. A task whose
// worker died, or whose waker did, comes back on asynq's own schedule, a
// second after its ticket's time; a ticket not used (its task deleted)
// leaves its instant to the next booking.
const (
	// lineViewFresh is how long a worker goes by what it last read of a
	// line's tail.
	lineViewFresh = time.Second
	// maxLineViews bounds the lines a worker remembers.
	maxLineViews = 10_000
	// lineLife: a line is kept this long after its last ticket's instant.
	lineLife = time.Minute
	lineTail = "t" // the member of a line's sorted set
)

// backlogLine is a gate's backlog line, for tasks of one cost.
type backlogLine struct {
	gate     string // metric label
	key      string
	interval int64 // µs between two turns of this cost at the gate's rate
	claim    claim // the gate's claim whose line it is
	cost     int
}

// lineOf is the backlog line of claim c for tasks of cost: in the queue's
// slot, named after the gate's version and key value, so that a changed
// limit starts a line of its own. ok is false for a claim with no rate.
func lineOf(queue string, c claim, cost int) (backlogLine, bool) {
	limit := c.g.limit
	if ov := c.g.overrides.of(c.key, true); ov != nil {
		limit = ov.limit
	}
	if limit.Limit <= 0 || limit.Period <= 0 {
		return backlogLine{}, false
	}
	line, rate := c.g.tag, float64(limit.Limit)
	if a := limit.Adaptive; a != nil {
		// An adaptive quota's limit changes often (adapt.go): one line for
		// all its versions, its tickets spaced at its highest rate, so that
		// whatever rate it learns later is fed (a task back before the
		// limit has a turn for it takes a ticket again: max - rate a
		// second). A keyed quota's line is a key value's, and a backlog
		// of many values would make that max - rate a second for each:
		// once the value's controller has met its upstream's limit, its
		// tickets are spaced at adaptiveLineFeed times its learned rate.
		line, rate, limit.Period = c.g.name, float64(a.Max), limit.RatePeriod()
		if c.g.expr != nil && limit.learned > 0 && !limit.searching {
			rate = min(rate, adaptiveLineFeed*limit.learned)
		}
	}
	sum := sha256.Sum256([]byte(line + "\x00" + c.key))
	return backlogLine{
		gate:     c.g.name,
		key:      backlogLineKey(queue, hex.EncodeToString(sum[:12])),
		interval: max(1, int64(float64(cost)*float64(limit.Period.Microseconds())/rate)),
		claim:    c,
		cost:     cost,
	}, true
}

// adaptiveLineFeed: a key value's backlog line of a keyed adaptive quota
// feeds its gate at this many times its learned rate.
const adaptiveLineFeed = 2

// lineViews is what a worker last read of the lines' tails.
type lineViews struct {
	mu    sync.Mutex
	tails map[string]lineView // line key -> its view
	// ahead is how far the limiters' clock is ahead of ours (µs), as
	// last seen.
	ahead int64
}

type lineView struct {
	tail int64     // µs, limiters' clock; 0: no line
	read time.Time // our clock
}

// limitersNow is the limiters' clock now, as last seen from here.
func (v *lineViews) limitersNow(now time.Time) int64 {
	v.mu.Lock()
	defer v.mu.Unlock()
	return now.UnixMicro() + v.ahead
}

// note remembers a line's tail, read or written at now.
func (v *lineViews) note(key string, tail int64, now time.Time) {
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.tails == nil || len(v.tails) >= maxLineViews {
		v.tails = map[string]lineView{} // the next reads fill it again
	}
	v.tails[key] = lineView{tail: tail, read: now}
}

// activeLine returns the longest of a fresh task's gates' lines, if one
// reaches further than a worker holds tasks for: the task then books only a
// turn it would wait for in the worker (its ticket's, if it is back for
// one; one kept under its booking ID; or a gap the line's tasks left), and
// otherwise takes a ticket behind the line: a turn further on is one the
// line's tasks are due to take. ok is false when no line does,
// or Redis failed (the task books as usual).
func (b *booker) activeLine(ctx context.Context, queue string, claims []claim, cost int) (backlogLine, bool) {
	now := b.clock.Now()
	// Most queues have no line: one look (a second old at most) at the
	// furthest tail of the queue's lines says so.
	furthest, err := b.readLines(ctx, []string{queueLines(queue)}, now)
	limitersNow := b.lines.limitersNow(now)
	if err != nil || furthest[0] <= limitersNow+alwaysHold.Microseconds() {
		return backlogLine{}, false
	}
	var lines []backlogLine
	for _, c := range claims {
		if l, ok := lineOf(queue, c, cost); ok {
			lines = append(lines, l)
		}
	}
	keys := make([]string, len(lines))
	for i, l := range lines {
		keys[i] = l.key
	}
	tails, err := b.readLines(ctx, keys, now)
	if err != nil {
		return backlogLine{}, false
	}
	longest := -1
	for i, tail := range tails {
		if tail > limitersNow+alwaysHold.Microseconds() && (longest < 0 || tail > tails[longest]) {
			longest = i
		}
	}
	if longest < 0 {
		return backlogLine{}, false
	}
	return lines[longest], true
}

// readLines returns the tails of the lines keys (0 for none), read again
// from Redis for those whose view is older than lineViewFresh, with Redis's
// clock.
func (b *booker) readLines(ctx context.Context, keys []string, now time.Time) ([]int64, error) {
	tails := make([]int64, len(keys))
	var stale []int
	b.lines.mu.Lock()
	for i, key := range keys {
		v, ok := b.lines.tails[key]
		if !ok || now.Sub(v.read) >= lineViewFresh {
			stale = append(stale, i)
		}
		tails[i] = v.tail
	}
	b.lines.mu.Unlock()
	if len(stale) == 0 {
		return tails, nil
	}
	pipe := b.rdb.Pipeline()
	scores := make([]*redis.FloatCmd, len(stale))
	for j, i := range stale {
		scores[j] = pipe.ZScore(ctx, keys[i], lineTail)
	}
	var clock *redis.TimeCmd
	if !b.clock.injected {
		clock = pipe.Time(ctx)
	}
	if _, err := pipe.Exec(ctx); err != nil && err != redis.Nil {
		return nil, err
	}
	if clock != nil {
		b.lines.mu.Lock()
		b.lines.ahead = clock.Val().UnixMicro() - now.UnixMicro()
		b.lines.mu.Unlock()
	}
	for j, i := range stale {
		tails[i] = int64(scores[j].Val()) // 0 if there is none
		b.lines.note(keys[i], tails[i], now)
	}
	return tails, nil
}

// deferToLine puts a task whose booking bk was refused in line l (active:
// a line ahead of it), or in the line of its refusing claim c from the
// earliest turn the refusal found.
func (b *booker) deferToLine(ctx context.Context, task taskRef, l backlogLine, active bool, c claim, cost int, bk throttle.Booking) (outcome, bool) {
	from := int64(0)
	if !active {
		var ok bool
		if l, ok = lineOf(task.queue, c, cost); !ok {
			return nil, false
		}
		from = bk.At.UnixMicro()
	}
	limitersNow := bk.At.Add(-bk.Delay).UnixMicro()
	b.lines.mu.Lock()
	b.lines.ahead = limitersNow - b.clock.Now().UnixMicro()
	b.lines.mu.Unlock()
	o, err := b.joinLine(ctx, task, l, from, limitersNow)
	return o, err == nil
}

// joinLine gives task id the next ticket of line l (not before from, if
// > 0) and notes it in the wake set, due back requeueLead before its
// ticket: back then, it books a turn it waits for in the worker. A task
// with no retry left is noted under the id of its copy instead (see
// requeue). limitersNow is the limiters' clock now (µs).
func (b *booker) joinLine(ctx context.Context, task taskRef, l backlogLine, from, limitersNow int64) (outcome, error) {
	ids := []string{task.id}
	if task.exhausted {
		ids = nil // back as a copy, under another id: it books
	}
	tickets, err := b.takeTickets(ctx, task.queue, l, from, limitersNow, ids, 1)
	if err != nil {
		return nil, err
	}
	wait := time.Duration(max(tickets[0]-requeueLead.Microseconds()-limitersNow, 1000)) * time.Microsecond
	if task.exhausted {
		return askAgainIn{wait}, nil
	}
	return notedIn{d: wait, line: &l}, nil
}

// takeTickets gives n tasks the next n tickets of line l (not before from,
// if > 0), in one step whatever n, and returns them (µs on the limiters'
// clock, limitersNow now). The tasks ids (n of them, or none) are noted in
// the wake set, each due back requeueLead before its ticket.
func (b *booker) takeTickets(ctx context.Context, queue string, l backlogLine, from, limitersNow int64, ids []string, n int) ([]int64, error) {
	pipe := b.rdb.Pipeline()
	if from > 0 {
		pipe.ZAddGT(ctx, l.key, redis.Z{Score: float64(from), Member: lineTail})
	}
	next := pipe.ZIncrBy(ctx, l.key, float64(int64(n)*l.interval), lineTail)
	// Kept past the furthest ticket known here; set exactly below.
	pipe.PExpire(ctx, l.key, time.Duration(max(from, limitersNow)+int64(n)*l.interval-limitersNow)*time.Microsecond+lineLife)
	if _, err := pipe.Exec(ctx); err != nil {
		b.log.Warn("cannot take a place in a backlog line; the task asks again in a second", "queue", queue, "gate", l.gate, "tasks", n, "err", err)
		return nil, err
	}
	tail := int64(next.Val())
	b.lines.note(l.key, tail, b.clock.Now())
	tickets := make([]int64, n)
	due := make([]redis.Z, len(ids))
	for i := range tickets {
		tickets[i] = tail - int64(n-i)*l.interval
		b.metrics.turnWait.WithLabelValues(queue).Observe(float64(max(tickets[i]-limitersNow, 0)) / 1e6)
		if i < len(ids) {
			due[i] = redis.Z{Score: float64(tickets[i] - requeueLead.Microseconds()), Member: ids[i]}
		}
	}
	b.metrics.decisions.WithLabelValues(l.gate, "deferred").Add(float64(n))
	pipe = b.rdb.Pipeline()
	life := time.Duration(tail-limitersNow)*time.Microsecond + lineLife
	pipe.PExpire(ctx, l.key, life)
	pipe.ZAddGT(ctx, queueLines(queue), redis.Z{Score: float64(tail), Member: lineTail})
	pipe.ExpireNX(ctx, queueLines(queue), life)
	pipe.ExpireGT(ctx, queueLines(queue), life)
	if len(due) > 0 {
		pipe.ZAdd(ctx, wakeKeys(queue)[0], due...)
	}
	if _, err := pipe.Exec(ctx); err != nil && len(due) > 0 {
		b.log.Warn("cannot note when waiting tasks are due; asynq brings them back a second late", "queue", queue, "tasks", len(due), "err", err)
	}
	return tickets, nil
}
