package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
)

// loadPool is how many Enqueue calls are in flight at once. asynq.Client
// has no batch API: one Enqueue is a round trip (a script call), so a pool
// of callers sharing one client keeps Redis busy instead of waiting on the
// network.
const loadPool = 32

// outcome is what became of one task.
type outcome uint8

const (
	notTried  outcome = iota // stopped before its turn: not in Redis
	enqueued                 // written now
	existed                  // its task id was taken: already enqueued
	duplicate                // refused by --unique: a task like it is there
	refused                  // not written: never sent, or Redis said no
	uncertain                // sent, but no answer came: it may be in Redis or not
)

// inRedis reports whether the task is surely in Redis, or one like it.
func (o outcome) inRedis() bool { return o == enqueued || o == existed || o == duplicate }

// result is one task's outcome.
type result struct {
	outcome outcome
	id      string // its task id, when in Redis (not for duplicates)
	err     error  // refused or uncertain
}

// load enqueues tasks from loadPool goroutines that share client, taking
// tasks in order, so that at most loadPool-1 tasks after one that failed
// were tried. On the first failure or when ctx is done it starts no more,
// waits for those in flight and returns every task's result. done counts
// the tasks that have their result.
func load(ctx context.Context, client *asynq.Client, tasks []task, done *atomic.Int64) []result {
	results := make([]result, len(tasks))
	var next atomic.Int64
	var halt atomic.Bool
	var wg sync.WaitGroup
	for range min(loadPool, len(tasks)) {
		wg.Go(func() {
			for !halt.Load() && ctx.Err() == nil {
				i := int(next.Add(1) - 1)
				if i >= len(tasks) {
					return
				}
				r := enqueueOne(client, tasks[i])
				results[i] = r
				done.Add(1)
				if !r.outcome.inRedis() {
					halt.Store(true)
				}
			}
		})
	}
	wg.Wait()
	return results
}

// enqueueOne enqueues t and says what became of it. It does not take the
// run's context: a call cut short after it was sent would leave its task
// uncertain for nothing.
func enqueueOne(client *asynq.Client, t task) result {
	probe := &writeProbe{}
	ctx := context.WithValue(context.Background(), probeKey{}, probe)
	info, err := client.EnqueueContext(ctx, t.task, t.opts...)
	switch {
	case err == nil:
		return result{outcome: enqueued, id: info.ID}
	case errors.Is(err, asynq.ErrTaskIDConflict):
		return result{outcome: existed, id: t.taskID}
	case errors.Is(err, asynq.ErrDuplicateTask):
		return result{outcome: duplicate}
	case probe.uncertain():
		return result{outcome: uncertain, err: err}
	}
	return result{outcome: refused, err: err}
}

// writeProbe rides in the context of one Enqueue call and keeps what
// became of the script call that writes the task; the go-redis hook
// writeHook fills it in. asynq turns that call's error into a string, so
// its error alone cannot tell "never sent" from "sent, no answer".
type writeProbe struct {
	tried bool  // the script was called
	err   error // the last script call's error
}

// uncertain reports whether the task may have been written: the script
// call was made, and failed after the request may have reached Redis. A
// failed dial or a Redis error reply (NOSCRIPT, OOM, READONLY ...) means it
// was not.
func (p *writeProbe) uncertain() bool {
	if !p.tried || p.err == nil {
		return false
	}
	var reply redis.Error
	var op *net.OpError
	switch {
	case errors.As(p.err, &reply),
		errors.As(p.err, &op) && op.Op == "dial",
		errors.Is(p.err, redis.ErrPoolTimeout),
		errors.Is(p.err, redis.ErrPoolExhausted),
		errors.Is(p.err, redis.ErrClosed):
		return false
	}
	return true
}

type probeKey struct{}

// writeHook is the go-redis hook that fills in each call's writeProbe.
type writeHook struct{}

func (writeHook) DialHook(next redis.DialHook) redis.DialHook { return next }

func (writeHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

func (writeHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		if p, ok := ctx.Value(probeKey{}).(*writeProbe); ok {
			if name := cmd.Name(); name == "evalsha" || name == "eval" {
				p.tried, p.err = true, err
			}
		}
		return err
	}
}

// The bounds of one batch of loadAll: tasks are read from their input a
// batch at a time, so what a load holds does not grow with the input.
const (
	loadBatch      = 4096
	loadBatchBytes = 8 << 20 // of payloads
)

// loadAll enqueues the tasks next yields, a batch at a time through load,
// and gives each task and its result to each, in order. The next batch is
// read while one loads, so the pool does not wait on the input. After a
// batch in which a task did not land, or once ctx is done, it tries no
// more: each gets the rest as not tried. An error from next ends it,
// returned.
func loadAll(ctx context.Context, client *asynq.Client, next func() (task, bool, error), done *atomic.Int64, each func(task, result)) error {
	type batch struct {
		tasks []task
		end   bool
		err   error
	}
	read := func() (b batch) {
		b.tasks = make([]task, 0, loadBatch)
		for size := 0; len(b.tasks) < loadBatch && size < loadBatchBytes; {
			t, ok, err := next()
			if err != nil || !ok {
				b.end, b.err = true, err
				return b
			}
			b.tasks = append(b.tasks, t)
			size += len(t.task.Payload())
		}
		return b
	}
	ahead := make(chan batch, 1)
	go func() { ahead <- read() }()
	halted := false
	for {
		b := <-ahead
		if !b.end {
			go func() { ahead <- read() }()
		}
		var results []result
		if halted {
			results = make([]result, len(b.tasks)) // all notTried
		} else {
			results = load(ctx, client, b.tasks, done)
		}
		for i, r := range results {
			each(b.tasks[i], r)
			halted = halted || !r.outcome.inRedis()
		}
		if b.end {
			return b.err
		}
	}
}

// tally is what became of the tasks of a load, told to add in their
// order: counts, and for each kind of outcome the ranges of lines (or
// copies) it holds. A load stops at its first failure, so outcomes change
// only near it, and the ranges stay few however long the input.
type tally struct {
	n        map[outcome]int
	tasks    int
	firstErr error
	// first is the line of the first task not surely in Redis; 0 while
	// there is none. A resumed run starts there.
	first int
	kinds [3]ranges // in Redis, uncertain, not enqueued
	// again holds the tasks from first on that are or may be in Redis and
	// have no task id: resuming would enqueue them a second time.
	again  ranges
	withID int // those from first on that are or may be in Redis and have a task id
}

// Kinds of outcome, as the report groups them.
const (
	kindInRedis = iota
	kindUncertain
	kindNotEnqueued
)

func newTally() *tally { return &tally{n: map[outcome]int{}} }

// add counts t's result r; t is the tally's next task.
func (y *tally) add(t task, r result) {
	i := y.tasks
	y.tasks++
	y.n[r.outcome]++
	if y.firstErr == nil {
		y.firstErr = r.err
	}
	kind := kindNotEnqueued
	switch {
	case r.outcome.inRedis():
		kind = kindInRedis
	case r.outcome == uncertain:
		kind = kindUncertain
	}
	y.kinds[kind].add(i, t.line)
	if y.first == 0 && kind != kindInRedis {
		y.first = t.line
	}
	if y.first != 0 && kind != kindNotEnqueued {
		if t.taskID == "" {
			y.again.add(i, t.line)
		} else {
			y.withID++
		}
	}
}

// landed is how many tasks are surely in Redis (or one like each is).
func (y *tally) landed() int { return y.n[enqueued] + y.n[existed] + y.n[duplicate] }

// ranges are runs of tasks that follow each other in a load, written as
// their lines: "1-500, 502, 504-600". Tasks next to each other in the load
// are one run whatever lies between their lines (blank lines).
type ranges struct {
	runs  [][2]int // first and last line
	count int
	last  int // the position in the load of the last task added
}

func (rs *ranges) add(position, line int) {
	if len(rs.runs) > 0 && position == rs.last+1 {
		rs.runs[len(rs.runs)-1][1] = line
	} else {
		rs.runs = append(rs.runs, [2]int{line, line})
	}
	rs.last = position
	rs.count++
}

func (rs *ranges) String() string {
	var b strings.Builder
	for _, run := range rs.runs {
		if b.Len() > 0 {
			b.WriteString(", ")
		}
		b.WriteString(strconv.Itoa(run[0]))
		if run[1] != run[0] {
			fmt.Fprintf(&b, "-%d", run[1])
		}
	}
	return b.String()
}
