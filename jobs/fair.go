package jobs

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/throttle"
)

// A queue with fairness shares its drain among the values of a key. Each
// task's turn is booked on the drain and on the queue's fair share at once
// (throttle.Book, one script run: both live under the queue's hash tag): a
// key may hold booked turns ahead for at most its weighted share of
// fairHorizon of the drain, in whole turns per unit of weight (see
// lua/fair.lua). A task whose key holds its share already is refused
// without counting, and waits in its key's line in Redis (park); the
// queue's waker lets tasks out of the lines as their key's share has
// room, and a task let out books as any other. So a
// backlog of one key never fills the drain's future: a newcomer's first
// task books behind at most max(fairHorizon of turns, W turns) and the
// turn due within the lead (see lead), W the sum of the weights of the
// keys with turns booked or tasks in line.
//
// A key held back by its own quota books where the quota puts its turn,
// later than the drain would: that turn is paced by the key, and does not
// count in its share of the drain's near future (it is spaced at the
// key's share's rate instead, and booked at most 1 s ahead: FAIR_REACH in
// lua/fair.lua; a task whose turn is further waits in its key's line until
// it is in reach, so that the pace follows the shares as keys come and
// go), so the key takes its full quota when that is less than its share,
// and the drain's other turns go to the others.
const (
	// fairHorizon is how much of the drain's future all keys together
	// may hold booked: short, so that a newcomer waits little, and within
	// alwaysHold, so that a task booked waits for its turn in the worker.
	fairHorizon = 300 * time.Millisecond
	// fairLead: a turn due within one turn of the drain, and at most this
	// soon, no longer counts in its key's share (FAIR_LEAD in
	// lua/fair.lua; see lead), so that the key's next task, let out of its
	// line, reaches a worker and books before the turn has passed: with a
	// share of one turn, the key kept 84% of a drain of 5/s in users' runs.
	fairLead = 200 * time.Millisecond
	// fairParkedView is how long a worker sends the fresh tasks of a key
	// refused its share straight to its line, without asking.
	fairParkedView = time.Second
	// fairLookKeys bounds the keys with a line that one look of the waker
	// serves (round robin, least recently served first).
	fairLookKeys = 1000
	// parkedFallback is added to the estimate of a parked task's wait for
	// asynq's own schedule: the waker lets it out of its line sooner.
	parkedFallback = 10 * time.Second
)

// fairGate is a queue's fair share of its drain.
type fairGate struct {
	name    string // metric label: "fair:<queue>"
	share   *gate  // the gate of a task's claim on the share (see bookTurn)
	queue   string
	expr    *keyExpr
	lim     throttle.Reserver
	keys    []string // FairKeys: state, aux, lines, keys, recent throttles
	weights map[string]int
	depth   int
	limit   int
	period  time.Duration
	// parked: key value -> until when (our clock) fresh tasks of the key
	// go straight to its line.
	mu     sync.Mutex
	parked map[string]time.Time
	// sweepAt: when refused next drops the views that ended.
	sweepAt time.Time
}

func newFairGate(rdb redis.UniversalClient, queue string, drain LimitConfig, f FairnessConfig, clock throttle.Clock) (*fairGate, error) {
	expr, err := compileKey(f.Key)
	if err != nil {
		return nil, fmt.Errorf("jobs: queues %q: fairness.key: %w", queue, err)
	}
	depth := max(1, int(int64(drain.Limit)*int64(fairHorizon)/int64(drain.Period)))
	// One state whatever the drain and weights, so that a live change
	// keeps the keys' lines (their tasks would come back only on asynq's
	// fallback): the state holds turns and lines, not rates, and each key's
	// weight is set anew whenever it is touched.
	const prefix = fairPrefix
	weight := func(key string) int {
		if w, ok := f.Weights[key]; ok {
			return w
		}
		return 1
	}
	opts := []throttle.Option{throttle.WithPrefix(prefix)}
	if clock != nil {
		opts = append(opts, throttle.WithClock(clock))
	}
	lim, err := throttle.NewFairShare(rdb, queue, throttle.FairSpec{Limit: drain.Limit, Period: drain.Period, Depth: depth, Weight: weight}, opts...)
	if err != nil {
		return nil, fmt.Errorf("jobs: queues %q: fairness: %w", queue, err)
	}
	name := GateName{FairGate, queue}.String()
	return &fairGate{name: name, share: &gate{name: name, fair: true}, queue: queue, expr: expr, lim: lim, keys: throttle.FairKeys(prefix, queue),
		weights: f.Weights, depth: depth, limit: drain.Limit, period: drain.Period}, nil
}

func (f *fairGate) weight(key string) int {
	if w, ok := f.weights[key]; ok {
		return w
	}
	return 1
}

// lineSpot is where a task refused its key's share waits: its key's line.
type lineSpot struct {
	fair    *fairGate
	key     string // the key value
	booking string // the task's booking ID
	cost    int
	// seen: sent to its line by this worker's view of its key, not by a
	// refusal: it may be a task let out of its line, which must book.
	seen bool
}

// park puts task id in its key's line and returns about how long until
// the waker lets it out (for asynq's own schedule, the fallback). letOut:
// the waker let it out already (a task the worker sent to its line by its
// view of the key, spot.seen), and it books instead.
func (s *Scheduler) park(ctx context.Context, queue, id string, spot *lineSpot) (est time.Duration, letOut bool, err error) {
	return s.runPark(ctx, queue, id, spot, false)
}

// lineWait is how long park would say, without putting the task in the
// line: a copy goes in its line only once its id is known to be its own.
func (s *Scheduler) lineWait(ctx context.Context, queue string, spot *lineSpot) (est time.Duration, letOut bool, err error) {
	return s.runPark(ctx, queue, "", spot, true)
}

func (s *Scheduler) runPark(ctx context.Context, queue, id string, spot *lineSpot, dry bool) (time.Duration, bool, error) {
	f := spot.fair
	keys := append(wakeKeys(queue), f.keys...)
	seen, estimate := "0", "0"
	if spot.seen {
		seen = "1"
	}
	if dry {
		estimate = "1"
	}
	us, err := wakeScript.Run(ctx, s.rdb, keys, s.clock.scriptNow(), "park", id, spot.booking, throttle.FairMember(spot.key),
		f.weight(spot.key), spot.cost, f.limit, f.period.Microseconds(), seen, estimate).Int64()
	if err != nil {
		return 0, false, err
	}
	if us < 0 {
		return 0, true, nil
	}
	return time.Duration(us) * time.Microsecond, false, nil
}

// parkedView reports whether fresh tasks of key go straight to its line:
// this worker saw its share refused a moment ago.
func (f *fairGate) parkedView(key string, now time.Time) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	until, ok := f.parked[key]
	return ok && now.Before(until)
}

// maxParkedViews bounds the keys a worker remembers as refused.
const maxParkedViews = 10_000

// refused notes that key's share was refused now.
func (f *fairGate) refused(key string, now time.Time) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if !now.Before(f.sweepAt) {
		// Into a new map: a Go map keeps its size after deletes. Every view
		// kept now ends within fairParkedView, by the next sweep.
		fresh := map[string]time.Time{}
		for k, until := range f.parked {
			if now.Before(until) {
				fresh[k] = until
			}
		}
		f.parked, f.sweepAt = fresh, now.Add(fairParkedView)
	}
	if len(f.parked) >= maxParkedViews {
		return // full of views from the last second or two: this key asks each time
	}
	f.parked[key] = now.Add(fairParkedView)
}

// lead is how soon a turn of the drain is due when it no longer counts
// in its key's share: one turn, at most fairLead (lua/fair.lua's
// fair_lead).
func (f *fairGate) lead() time.Duration {
	return min(fairLead, (f.period+time.Duration(f.limit)-1)/time.Duration(f.limit))
}

// linedKeys is the key of the set of key values with tasks in line.
func (f *fairGate) linedKeys() string { return f.keys[3] }

// wakeArgs are the extra keys and arguments of the waker's look at a fair
// queue: it lets tasks out of the lines.
func (f *fairGate) wakeArgs() ([]string, []any) {
	return f.keys, []any{f.depth, fairLookKeys, f.limit, f.period.Microseconds()}
}
