package jobs

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/internal/redistest"
	"github.com/sluicehq/sluice/internal/testkit"
	"github.com/sluicehq/sluice/throttle"
)

// t0 is aligned to every period the tests use.
var t0 = time.Unix(1_800_000_000, 0)

const ms = time.Millisecond

// bookingFixture is a Scheduler on a manual clock, with a queue drained at
// 25/s (burst 1) whose task type draws on quotas, on the standalone server
// or rdb.
type bookingFixture struct {
	s      *Scheduler
	clock  *testkit.Clock
	queue  string
	quotas []string
	tasks  int // booked by readyTimes
}

// limit is a quota or drain spec for the fixtures.
func limit(algorithm string, perSecond, burst int, policy string) LimitConfig {
	return LimitConfig{Algorithm: algorithm, Limit: perSecond, Period: time.Second, Burst: burst, OnRedisError: policy}
}

func newBookingFixture(t *testing.T, rdb redis.UniversalClient, drain LimitConfig, quotas ...LimitConfig) *bookingFixture {
	t.Helper()
	f := &bookingFixture{clock: testkit.NewClock(t0), queue: redistest.Queue(t, "q")}
	cfg := Config{
		Queues: map[string]QueueConfig{f.queue: {Drain: &drain}},
		Quotas: map[string]LimitConfig{},
		Tasks:  map[string]TaskConfig{},
	}
	for i, q := range quotas {
		name := redistest.Queue(t, fmt.Sprint("api", i))
		f.quotas = append(f.quotas, name)
		cfg.Quotas[name] = q
	}
	cfg.Tasks["test:call"] = TaskConfig{Quotas: f.quotas}
	s, err := NewScheduler(rdb, asynq.RedisClientOpt{Addr: redistest.Addr(t)}, cfg,
		NewMetrics(prometheus.NewRegistry()), slog.New(slog.NewTextHandler(io.Discard, nil)), WithClock(f.clock))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	f.s = s
	return f
}

// bookedView is an outcome as the tests read it.
type bookedView struct {
	outcome
	bookedTurns               // runNow's or turnAhead's
	ready       time.Time     // when its turns come: runNow's now, or turnAhead's ready
	askIn       time.Duration // askAgainIn's or notedIn's
	line        *lineSpot     // waitInLine's
}

// bookTask books task t, id in queue, on gs with bk as a task of ctx (a
// background context: a task from its producer with no retry left).
func bookTask(ctx context.Context, bk *booker, gs *gateSet, queue, id string, t *asynq.Task, letOut bool) (bookedView, error) {
	o, err := bk.book(ctx, gs, refOf(ctx, queue, id, t), letOut)
	if err != nil {
		return bookedView{}, err
	}
	b := bookedView{outcome: o}
	switch o := o.(type) {
	case runNow:
		b.bookedTurns, b.ready = o.turns, bk.clock.Now()
	case turnAhead:
		b.bookedTurns, b.ready = o.turns, o.ready
	case notedIn:
		b.askIn = o.d
	case askAgainIn:
		b.askIn = o.d
	case waitInLine:
		b.line = o.spot
	}
	return b, nil
}

// book books task id of test:call.
func (f *bookingFixture) book(t *testing.T, id string) bookedView {
	t.Helper()
	b, err := bookTask(context.Background(), f.s.booker, f.s.gates.Load(), f.queue, id, asynq.NewTask("test:call", nil), false)
	if err != nil {
		t.Fatalf("book: %v", err)
	}
	return b
}

// readyTimes books n new tasks and returns when each may run, from t0.
func (f *bookingFixture) readyTimes(t *testing.T, n int) []time.Duration {
	t.Helper()
	var got []time.Duration
	for range n {
		f.tasks++
		b := f.book(t, fmt.Sprint("task-", f.tasks))
		if b.askIn > 0 {
			t.Fatalf("booking deferred by %v", b.askIn)
		}
		for _, turn := range b.turns {
			if !turn.At.Equal(b.ready) {
				t.Fatalf("turns %+v not all at the task's instant %v", b.turns, b.ready.Sub(t0))
			}
		}
		got = append(got, b.ready.Sub(t0))
	}
	return got
}

func durations(ms ...int) string {
	var ds []time.Duration
	for _, m := range ms {
		ds = append(ds, time.Duration(m)*time.Millisecond)
	}
	return fmt.Sprint(ds)
}

// TestBookTwoGates: a drain of 25/s and a quota of 10/s burst 5: the
// earliest instant both admit each task, 40ms apart while the quota's
// burst lasts, then at the quota's pace.
func TestBookTwoGates(t *testing.T) {
	f := newBookingFixture(t, redistest.Client(t), limit("leaky_bucket", 25, 1, "deny"), limit("token_bucket", 10, 5, "deny"))
	got := f.readyTimes(t, 12)
	if want := durations(0, 40, 80, 120, 160, 200, 240, 300, 400, 500, 600, 700); fmt.Sprint(got) != want {
		t.Fatalf("tasks ready at %v, want %v", got, want)
	}
}

// TestBookThreeGates: the drain, a quota of 10/s burst 5 and another of
// 4/s burst 2: the third binds from the third task on, 250ms apart.
func TestBookThreeGates(t *testing.T) {
	f := newBookingFixture(t, redistest.Cluster(t), limit("leaky_bucket", 25, 1, "deny"),
		limit("token_bucket", 10, 5, "deny"), limit("token_bucket", 4, 2, "deny"))
	got := f.readyTimes(t, 6)
	if want := durations(0, 40, 250, 500, 750, 1000); fmt.Sprint(got) != want {
		t.Fatalf("tasks ready at %v, want %v", got, want)
	}
}

// TestBookRedisFails: the limits' Redis is down; each policy decides.
func TestBookRedisFails(t *testing.T) {
	t.Parallel()
	dead := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", MaxRetries: -1, DialTimeout: 50 * ms})
	t.Cleanup(func() { dead.Close() })
	t.Run("deny: ask again in a second, from Redis", func(t *testing.T) {
		f := newBookingFixture(t, dead, limit("leaky_bucket", 25, 1, "deny"), limit("token_bucket", 10, 5, "deny"))
		if b := f.book(t, "t"); b.outcome != (askAgainIn{redisRetry}) {
			t.Fatalf("outcome %+v, want askAgainIn %v (no turn)", b.outcome, redisRetry)
		}
	})
	t.Run("allow: run now", func(t *testing.T) {
		f := newBookingFixture(t, dead, limit("leaky_bucket", 25, 1, "allow"), limit("token_bucket", 10, 5, "allow"))
		for i := range 3 {
			b := f.book(t, fmt.Sprint("t", i))
			if _, ok := b.outcome.(runNow); !ok || len(b.turns) != 2 || b.turns[0].Fallback != "allow" || b.turns[1].Fallback != "allow" {
				t.Fatalf("task %d: %+v, want runNow, both gates' turns let through by the allow policy", i, b.outcome)
			}
		}
	})
	t.Run("local: the limits in process", func(t *testing.T) {
		f := newBookingFixture(t, dead, limit("leaky_bucket", 25, 1, "local"), limit("token_bucket", 10, 5, "local"))
		f.s.fleet.n.Store(1) // a fleet of one, counted (Run counts it)
		if got, want := f.readyTimes(t, 8), durations(0, 40, 80, 120, 160, 200, 240, 300); fmt.Sprint(got) != want {
			t.Fatalf("tasks ready at %v, want %v", got, want)
		}
	})
	t.Run("local before the fleet is counted: ask again in a second", func(t *testing.T) {
		f := newBookingFixture(t, dead, limit("leaky_bucket", 25, 1, "local"))
		if b := f.book(t, "t"); b.outcome != (askAgainIn{redisRetry}) {
			t.Fatalf("outcome %+v, want askAgainIn %v (no turn)", b.outcome, redisRetry)
		}
	})
	t.Run("one gate denies, the other allows: ask again", func(t *testing.T) {
		f := newBookingFixture(t, dead, limit("leaky_bucket", 25, 1, "allow"), limit("token_bucket", 10, 5, "deny"))
		if b := f.book(t, "t"); b.outcome != (askAgainIn{redisRetry}) {
			t.Fatalf("outcome %+v, want askAgainIn %v: the quota's policy is deny", b.outcome, redisRetry)
		}
	})
}

// TestTurnGivenBack: a task that will not use its turn gives it back, and
// the next task gets it.
func TestTurnGivenBack(t *testing.T) {
	f := newBookingFixture(t, redistest.Client(t), limit("leaky_bucket", 25, 1, "deny"), limit("token_bucket", 10, 5, "deny"))
	first, second := f.book(t, "first"), f.book(t, "second")
	f.s.giveBack(context.Background(), first.bookedTurns)
	if third := f.book(t, "third"); !third.ready.Equal(first.ready) {
		t.Fatalf("after the first turn (%v) was given back, the next task got %v (the second holds %v)",
			first.ready.Sub(t0), third.ready.Sub(t0), second.ready.Sub(t0))
	}
}

// TestTaskBackForItsTurn: a task back from Redis for its turn gets it
// (booked under its ID), counting nothing; a copy of it too (its origin
// names it); back later than lateTolerance, or after a gate changed, it
// books anew, and what it held goes to the next task. A task goes to Redis
// only for a turn further than alwaysHold (nearer, the worker waits for it
// and keeps no turn under its ID: throttle.KeepAfter): the drain's turns
// are 200ms apart, so that three tasks ahead put its turn past it.
func TestTaskBackForItsTurn(t *testing.T) {
	const step = 200 * ms // the drain's turns
	f := newBookingFixture(t, redistest.Client(t), limit("leaky_bucket", 5, 1, "deny"), limit("token_bucket", 10, 5, "deny"))
	f.readyTimes(t, 3) // turns at 0 to 400ms
	waiting := f.book(t, "waiting")
	if want := t0.Add(3 * step); !waiting.ready.Equal(want) || 3*step <= alwaysHold {
		t.Fatalf("waiting task ready at %v, want %v", waiting.ready.Sub(t0), want.Sub(t0))
	}
	back := func(id string, headers map[string]string) bookedView {
		t.Helper()
		b, err := bookTask(context.Background(), f.s.booker, f.s.gates.Load(), f.queue, id, asynq.NewTaskWithHeaders("test:call", nil, headers), false)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	f.clock.Set(t0.Add(150 * ms))
	if b := back("waiting", nil); !b.ready.Equal(waiting.ready) {
		t.Fatalf("task back for its turn at +%v got %v", 3*step, b.ready.Sub(t0))
	}
	if b := back("waiting~1", map[string]string{headerOrigin: "waiting", headerHop: "1"}); !b.ready.Equal(waiting.ready) {
		t.Fatalf("its copy back for the turn at +%v got %v", 3*step, b.ready.Sub(t0))
	}
	if got := testutil.ToFloat64(f.s.metrics.decisions.WithLabelValues(f.s.gates.Load().drains[f.queue].name, "held")); got != 2 {
		t.Fatalf("%v decisions held, want the 2 returns", got)
	}

	f.clock.Set(t0.Add(3*step + lateTolerance + ms))
	if late := back("waiting", nil); !late.ready.Equal(f.clock.Now()) {
		t.Fatalf("a task back %v after its turn got %v; want a new turn, now", lateTolerance+ms, late.ready.Sub(t0))
	}

	// The quota changes while a task waits for its turn: back, it gives back
	// the drain turn it held and books anew on both gates in one step: the
	// drain's turn it gave back is free for it again (the next task's is a
	// step later), where it would come after the next task's had its turn
	// stayed counted.
	f.clock.Set(t0.Add(2 * time.Second))
	f.readyTimes(t, 3)
	held := f.book(t, "held") // 3 steps ahead: kept under its ID
	cfg := f.s.Config()
	cfg.Quotas[f.quotas[0]] = limit("token_bucket", 20, 5, "deny")
	if err := f.s.Apply(cfg); err != nil {
		t.Fatal(err)
	}
	next := f.book(t, "next")
	if !next.ready.Equal(held.ready.Add(step)) {
		t.Fatalf("next task at %v; want %v after the held one's drain turn %v", next.ready.Sub(t0), step, held.ready.Sub(t0))
	}
	rebooked := back("held", nil)
	if !rebooked.ready.Equal(held.ready) {
		t.Fatalf("the held task rebooked under the new quota at %v; want its drain turn %v again, given back and booked in one step (the next task's is %v)", rebooked.ready.Sub(t0), held.ready.Sub(t0), next.ready.Sub(t0))
	}
	gs := f.s.gates.Load()
	for i, g := range gs.routeOf(f.queue, "test:call").gates {
		if rebooked.claims[i].g != g {
			t.Fatalf("rebooked on gate %q, want the gate in force %q", rebooked.claims[i].g.tag, g.tag)
		}
	}
	if again := f.book(t, "again"); !again.ready.Equal(next.ready.Add(step)) {
		t.Fatalf("a new task at %v; want after the others, %v", again.ready.Sub(t0), next.ready.Add(step).Sub(t0))
	}
}

// TestNearTurnNotKept (issue 20, commands per task): a turn the worker
// waits for whatever the room (within alwaysHold) is not kept under the
// task's booking ID, a SET less per booking; one further, for which the
// task may go back to Redis, is. (Before, every turn after now was kept.)
func TestNearTurnNotKept(t *testing.T) {
	const step = 200 * ms
	f := newBookingFixture(t, redistest.Client(t), limit("leaky_bucket", 5, 1, "deny"), limit("token_bucket", 10, 5, "deny"))
	kept := func(id string, b bookedView) bool {
		t.Helper()
		c := b.claims[0]
		_, ok, err := throttle.KeptTurn(context.Background(), c.lim, c.key, bookingID(f.queue, id, asynq.NewTask("test:call", nil)))
		if err != nil {
			t.Fatal(err)
		}
		return ok
	}
	f.book(t, "now")
	for i, wantKept := range []bool{false, false, true} { // +200ms, +400ms, +600ms
		id := fmt.Sprint("task-", i)
		b := f.book(t, id)
		ahead := b.ready.Sub(t0)
		if ahead != time.Duration(i+1)*step {
			t.Fatalf("%s at +%v, want +%v", id, ahead, time.Duration(i+1)*step)
		}
		if got := kept(id, b); got != wantKept {
			t.Errorf("%s, its turn %v ahead (alwaysHold %v): kept under its ID %v, want %v", id, ahead, alwaysHold, got, wantKept)
		}
	}
}

// TestBookingIDBounded (19.4): a booking ID past maxBookingID bytes is
// "#" and a hash, the same for the task and its copies; since every other
// booking ID has a '/', no task whose id a producer chose has it.
func TestBookingIDBounded(t *testing.T) {
	long := strings.Repeat("x", maxBookingID)
	hashed := bookingID("q", long, asynq.NewTask("t", nil))
	copied := bookingID("q", long+"~1", asynq.NewTaskWithHeaders("t", nil, map[string]string{headerOrigin: long}))
	if len(hashed) != 65 || hashed[0] != '#' || strings.Contains(hashed, "/") || copied != hashed {
		t.Fatalf("booking IDs of a long id and of its copy: %.80q, %.80q; want one, \"#\" and 64 hex digits", hashed, copied)
	}
	for _, id := range []string{hashed, hashed[1:], "q/" + hashed} {
		if got := bookingID("q", id, asynq.NewTask("t", nil)); got == hashed {
			t.Errorf("the task with id %q has the long id's booking ID", id)
		}
	}
	if got := bookingID("q", long[:maxBookingID-2], asynq.NewTask("t", nil)); got != "q/"+long[:maxBookingID-2] {
		t.Errorf("a booking ID of %d bytes was changed to %.40q", maxBookingID, got)
	}
}

// TestBookLentOnManualClock: gates far from their limits lend a task a
// turn from their pool's lease on the Scheduler's manual clock too: ready
// at once, with no turn of its own to give back, 8 tasks on one script run
// per gate; once the clock passes the lease's span, the next task leases
// anew.
func TestBookLentOnManualClock(t *testing.T) {
	f := newBookingFixture(t, redistest.Client(t), limit("token_bucket", 100, 100, "deny"), limit("token_bucket", 200, 200, "deny"))
	gs := f.s.gates.Load()
	drain := gs.drains[f.queue]
	lent := func() float64 { return testutil.ToFloat64(f.s.metrics.decisions.WithLabelValues(drain.name, "lent")) }
	runs := func() float64 { return testutil.ToFloat64(f.s.metrics.evaluations.WithLabelValues(drain.name)) }
	for i := range 8 {
		b := f.book(t, fmt.Sprint("task-", i))
		if len(b.claims) != 0 || !b.ready.Equal(f.clock.Now()) || b.askIn != 0 {
			t.Fatalf("task %d: booking %+v, want a turn lent now (%v)", i, b, f.clock.Now().Sub(t0))
		}
	}
	if n, r := lent(), runs(); n != 8 || r != 1 {
		t.Fatalf("8 tasks: %v lent, %v script runs on the drain; want 8 lent on 1 lease", n, r)
	}
	f.clock.Add(time.Second) // past the span (500ms for the drain's window of 1s)
	testkit.WaitFor(t, 5*time.Second, "the lease to end", func() bool { return f.clock.Waiting() == 0 })
	if b := f.book(t, "after"); len(b.claims) != 0 || !b.ready.Equal(f.clock.Now()) {
		t.Fatalf("after the span: booking %+v, want a turn lent now", b)
	}
	if n, r := lent(), runs(); n != 9 || r != 2 {
		t.Fatalf("after the span: %v lent, %v script runs on the drain; want 9 lent on 2 leases (the first spent: nothing to give back)", n, r)
	}
}

// TestNotLentBehindALine (issue 20, commands per task): a gate with a
// backlog line ahead (further than a worker holds a task for) lends no
// turn: a fresh task then books a turn it waits for here, or takes a
// ticket behind the line. Before, it was lent a turn from the pool's
// lease, which jumped the line's tasks; and while the gate bound, each
// worker's pool tried a lease once a second, its turn given back unused:
// a gap in the gate's future that every booking then read round (a third
// more Redis commands for the bucket's spans in a deep backlog).
func TestNotLentBehindALine(t *testing.T) {
	f := newBookingFixture(t, redistest.Client(t), limit("token_bucket", 100, 100, "deny"), limit("token_bucket", 200, 200, "deny"))
	ctx := context.Background()
	gs := f.s.gates.Load()
	drain := gs.drains[f.queue]
	lent := func() float64 { return testutil.ToFloat64(f.s.metrics.decisions.WithLabelValues(drain.name, "lent")) }
	// A line on the drain whose tail is 10 s ahead, as a refused backlog
	// leaves it.
	r := gs.routeOf(f.queue, "test:call")
	l, ok := lineOf(f.queue, r.claims[0], r.cost)
	if !ok {
		t.Fatal("the drain has no backlog line")
	}
	now := f.clock.Now().UnixMicro()
	if _, err := f.s.booker.takeTickets(ctx, f.queue, l, now+(10*time.Second).Microseconds(), now, nil, 1); err != nil {
		t.Fatal(err)
	}
	b := f.book(t, "fresh")
	if n := lent(); n != 0 {
		t.Fatalf("a fresh task behind a line 10s long was lent a turn (%v lent; booking %+v); want none lent", n, b)
	}
	if b.askIn == 0 && len(b.claims) == 0 {
		t.Fatalf("a fresh task behind a line: %+v; want a turn booked on its gates or a ticket", b)
	}
}

// TestBookedTurnOnTwoGates: a task's gates decide one outcome. On a drain
// of 25/s and a quota of 10/s burst 5, the first task runs now and the
// second's turn is 40ms ahead (turnAhead), each with one turn per gate at
// the task's instant (on a manual clock, ours and the limiters' agree);
// given back, that turn is the next task's.
func TestBookedTurnOnTwoGates(t *testing.T) {
	f := newBookingFixture(t, redistest.Client(t), limit("leaky_bucket", 25, 1, "deny"), limit("token_bucket", 10, 5, "deny"))
	gates := f.s.gates.Load().routeOf(f.queue, "test:call").gates
	checkTurns := func(b bookedView, at time.Time) {
		t.Helper()
		if len(b.claims) != len(gates) || len(b.turns) != len(gates) {
			t.Fatalf("%d claims and %d turns, want one per gate (%d)", len(b.claims), len(b.turns), len(gates))
		}
		for i, g := range gates {
			if b.claims[i].g != g || !b.turns[i].At.Equal(at) {
				t.Fatalf("turn %d on %q at %v, want on %q at %v", i, b.claims[i].g.name, b.turns[i].At.Sub(t0), g.name, at.Sub(t0))
			}
		}
	}
	first := f.book(t, "first")
	if _, ok := first.outcome.(runNow); !ok {
		t.Fatalf("the first task: %T, want runNow", first.outcome)
	}
	checkTurns(first, t0)
	second := f.book(t, "second")
	ahead, ok := second.outcome.(turnAhead)
	if !ok || !ahead.ready.Equal(t0.Add(40*ms)) || !ahead.at.Equal(ahead.ready) {
		t.Fatalf("the second task: %+v, want turnAhead ready at +40ms", second.outcome)
	}
	checkTurns(second, t0.Add(40*ms))
	f.s.giveBack(context.Background(), second.bookedTurns)
	if third := f.book(t, "third"); !third.ready.Equal(ahead.ready) {
		t.Fatalf("after the second task gave its turn back, the next got +%v, want +40ms", third.ready.Sub(t0))
	}
}

// TestBookFairLine: in a fair queue at 10/s, a key's tasks book turns
// (the fair share's claim right after the drain's, given back with them)
// until the key holds its share; then a task waits in its key's line
// (waitInLine), and the key's next fresh task is sent there too without a
// booking (this worker's view of the key). Another key still books. Let
// out by the waker, the first waiting task books.
func TestBookFairLine(t *testing.T) {
	f := newFairFixture(t, 10, "payload.t", nil)
	bookings := func() float64 { return testutil.ToFloat64(f.s.metrics.bookings.WithLabelValues(f.queue)) }
	var waiting string
	for i := range 10 {
		id := fmt.Sprint("a-", i)
		b := f.offer(t, id, tenant("a"), false)
		if b.line != nil {
			if i < 2 {
				t.Fatalf("task %d of key a sent to its line; want at least two booked (the share holds 3 turns)", i)
			}
			waiting = id
			break
		}
		if len(b.claims) != 2 || b.claims[0].g != f.s.gates.Load().drains[f.queue] || !b.claims[1].g.fair || b.claims[1].key != "a" {
			t.Fatalf("task %s's claims %+v, want the drain's then key a's on the fair share", id, b.claims)
		}
	}
	if waiting == "" {
		t.Fatal("10 tasks of key a booked: its share never refused one")
	}
	before := bookings()
	if b := f.offer(t, "a-next", tenant("a"), false); b.line == nil || !b.line.seen {
		t.Fatalf("key a's next fresh task: %+v, want sent to its line by this worker's view", b.outcome)
	}
	if got := bookings(); got != before {
		t.Fatalf("%v bookings for a task sent to its line by the view, want none", got-before)
	}
	if b := f.offer(t, "b-0", tenant("b"), false); b.line != nil {
		t.Fatal("key b's first task was sent to its line, want it booked")
	}
	for range 30 {
		f.clock.Add(100 * ms)
		for _, id := range f.letOut(t) {
			if id != waiting {
				continue
			}
			if b := f.offer(t, id, tenant("a"), true); b.line != nil {
				t.Fatalf("task %s let out of its line: %+v, want it booked", id, b.outcome)
			}
			return
		}
	}
	t.Fatalf("task %s was not let out of its line in 3s", waiting)
}

// TestBookLiveChange: a task holds a turn 40ms ahead on the drain when a
// live change raises the drain from 25/s to 50/s: its wait ends
// (limitsChanged), it gives its turn back (giveBackStale, through what it
// has taken) and books again under the new limit, where what the old one
// counted still counts (a change of rate, not a reset): at +40ms, when the
// task that ran leaves the old bucket, not at once; the next task 20ms
// after it, at the new rate.
func TestBookLiveChange(t *testing.T) {
	f := newBookingFixture(t, redistest.Client(t), limit("leaky_bucket", 25, 1, "deny"))
	f.book(t, "ran")
	held := f.book(t, "held")
	ahead, ok := held.outcome.(turnAhead)
	if !ok || !ahead.ready.Equal(t0.Add(40*ms)) {
		t.Fatalf("the second task: %+v, want turnAhead at +40ms", held.outcome)
	}
	ctx := context.Background()
	gs := f.s.gates.Load()
	task := refOf(ctx, f.queue, "held", asynq.NewTask("test:call", nil))
	result := make(chan holdResult, 1)
	go func() { result <- f.s.hold(ctx, gs, task, ahead.ready.Sub(f.clock.Now()), nil) }()
	testkit.WaitFor(t, 5*time.Second, "the task to wait in the worker", func() bool { return f.clock.Waiting() > 0 })
	cfg := f.s.Config()
	raised := limit("leaky_bucket", 50, 1, "deny")
	cfg.Queues[f.queue] = QueueConfig{Drain: &raised}
	if err := f.s.Apply(cfg); err != nil {
		t.Fatal(err)
	}
	if got := <-result; got != limitsChanged {
		t.Fatalf("the wait ended with %v, want limitsChanged", got)
	}
	tk := &taken{s: f.s, ctx: ctx, queue: f.queue, turns: ahead.turns}
	f.s.giveBackStale(ctx, gs, tk)
	if len(tk.turns.claims) != 0 {
		t.Fatal("the task still holds its stale turns after giving them back")
	}
	again, err := bookTask(ctx, f.s.booker, f.s.gates.Load(), f.queue, "held", asynq.NewTask("test:call", nil), false)
	if err != nil {
		t.Fatal(err)
	}
	if !again.ready.Equal(t0.Add(40 * ms)) {
		t.Fatalf("booked again at +%v, want +40ms: its own turn given back, the one that ran still counted", again.ready.Sub(t0))
	}
	if again.claims[0].g != f.s.gates.Load().drains[f.queue] {
		t.Fatalf("booked again on %q, want the drain in force", again.claims[0].g.tag)
	}
	if next := f.book(t, "next"); !next.ready.Equal(t0.Add(60 * ms)) {
		t.Fatalf("the next task at +%v, want +60ms: 20ms after, at the new rate", next.ready.Sub(t0))
	}
}

// TestLentTurn: a fresh task on gates far from their limits is lent a
// turn by its gates' pool: it runs now, with no turn of its own to give
// back, and the gates count it as lent; a task back from Redis (not fresh)
// books. Pools lend only on Redis's clock (gateSet.lend is off under an
// injected one), so this test runs on it.
func TestLentTurn(t *testing.T) {
	queue, quota := redistest.Queue(t, "q"), redistest.Queue(t, "api")
	drain := limit("token_bucket", 10_000, 10_000, "deny")
	s := newTestScheduler(t, Config{
		Queues: map[string]QueueConfig{queue: {Drain: &drain}},
		Quotas: map[string]LimitConfig{quota: limit("token_bucket", 10_000, 10_000, "deny")},
		Tasks:  map[string]TaskConfig{"test:call": {Quotas: []string{quota}}},
	})
	ctx := context.Background()
	lent := func() float64 {
		return testutil.ToFloat64(s.metrics.decisions.WithLabelValues(s.gates.Load().drains[queue].name, "lent"))
	}
	var b bookedView
	testkit.WaitFor(t, 5*time.Second, "a turn lent", func() bool {
		var err error
		if b, err = bookTask(ctx, s.booker, s.gates.Load(), queue, "fresh", asynq.NewTask("test:call", nil), false); err != nil {
			t.Fatal(err)
		}
		return lent() > 0
	})
	if _, ok := b.outcome.(runNow); !ok || len(b.claims) != 0 {
		t.Fatalf("a lent turn: %+v, want runNow with no turn to give back", b.outcome)
	}
	before := lent()
	back := asynq.NewTaskWithHeaders("test:call", nil, map[string]string{headerOrigin: "fresh", headerHop: "1"})
	b, err := bookTask(ctx, s.booker, s.gates.Load(), queue, "fresh~1", back, false)
	if err != nil {
		t.Fatal(err)
	}
	if lent() != before || len(b.claims) != 2 {
		t.Fatalf("a task back from Redis: %+v, %v more lent; want it booked on both gates", b.outcome, lent()-before)
	}
}

// TestBookerAlone: booking needs the limits' Redis and a gate set, no
// Scheduler and no asynq client: a booker built alone on a manual clock
// books a drain of 25/s with a quota of 10/s burst 5 as the Scheduler does
// (TestBookTwoGates), and its outcomes say so: runNow, then turnAhead.
func TestBookerAlone(t *testing.T) {
	rdb := redistest.Client(t)
	clock := testkit.NewClock(t0)
	queue, quota := redistest.Queue(t, "q"), redistest.Queue(t, "api")
	drain := limit("leaky_bucket", 25, 1, "deny")
	cfg := Config{
		Queues: map[string]QueueConfig{queue: {Drain: &drain}},
		Quotas: map[string]LimitConfig{quota: limit("token_bucket", 10, 5, "deny")},
		Tasks:  map[string]TaskConfig{"test:call": {Quotas: []string{quota}}},
	}.Defaults()
	m := NewMetrics(prometheus.NewRegistry())
	gs, err := newGateSet(rdb, cfg, gateOptions{clock: clock, evaluations: m.evaluations})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(gs.close)
	bk := newBooker(rdb, m, slog.New(slog.NewTextHandler(io.Discard, nil)), schedClock{Clock: clock, injected: true})
	var got []time.Duration
	for i := range 8 {
		b, err := bookTask(context.Background(), bk, gs, queue, fmt.Sprint("task-", i), asynq.NewTask("test:call", nil), false)
		if err != nil {
			t.Fatal(err)
		}
		switch b.outcome.(type) {
		case runNow:
			if i > 0 {
				t.Fatalf("task %d runs now, want a turn ahead", i)
			}
		case turnAhead:
		default:
			t.Fatalf("task %d: %+v, want runNow or turnAhead", i, b.outcome)
		}
		got = append(got, b.ready.Sub(t0))
	}
	if want := durations(0, 40, 80, 120, 160, 200, 240, 300); fmt.Sprint(got) != want {
		t.Fatalf("tasks ready at %v, want %v", got, want)
	}
}
