package producer

import (
	"context"
	"errors"
	"net"
	"sync"
	"sync/atomic"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
)

// LoadPool is how many Enqueue calls a Loader has in flight at once: give
// its Redis client a pool of at least as many connections. asynq.Client
// has no batch API: one Enqueue is a round trip (a script call), so a pool
// of callers sharing one client keeps Redis busy instead of waiting on the
// network.
const LoadPool = 32

// Outcome is what became of one task.
type Outcome uint8

const (
	NotTried  Outcome = iota // stopped before its turn: not in Redis
	Enqueued                 // written now
	Existed                  // its task id was taken: already enqueued
	Duplicate                // refused by asynq.Unique: a task like it is there
	Refused                  // not written: never sent, or Redis said no
	Uncertain                // sent, but no answer came: it may be in Redis or not
)

// InRedis reports whether the task is surely in Redis, or one like it.
func (o Outcome) InRedis() bool { return o == Enqueued || o == Existed || o == Duplicate }

// Result is one task's outcome.
type Result struct {
	Outcome Outcome
	ID      string // its task id, when in Redis (not for duplicates)
	Err     error  // refused or uncertain
}

// Loader enqueues tasks through one Redis client and says what became of
// each; see Load.
type Loader struct {
	client *asynq.Client
	// shards, if set, gives a queue's shard count: each task goes to one
	// of its queue's shards (Spread.Task).
	shards func(queue string) int
	spread Spread
}

// SpreadOver has l spread each task over its queue's shards, shards(queue)
// of them (a config.File's Shards): see Spread.Task. Call it before Load.
func (l *Loader) SpreadOver(shards func(queue string) int) { l.shards = shards }

// NewLoader returns a Loader that enqueues through rdb, whose pool should
// hold LoadPool connections, and which the caller closes after the
// Loader's last use. It adds a hook to rdb that keeps what became of each
// write; give rdb no retries (MaxRetries -1): a retried call hides what
// became of the first attempt (a reply lost after the server ran the
// script, then "connection refused"), which would make the report of what
// landed wrong.
func NewLoader(rdb redis.UniversalClient) *Loader {
	rdb.AddHook(writeHook{})
	return &Loader{client: asynq.NewClientFromRedisClient(rdb)}
}

// load enqueues tasks from LoadPool goroutines, taking tasks in order, so
// that at most LoadPool-1 tasks after one that failed were tried. On the
// first failure or when ctx is done it starts no more, waits for those in
// flight and returns every task's result. done counts the tasks that have
// their result.
func (l *Loader) load(ctx context.Context, tasks []Task, done *atomic.Int64) []Result {
	results := make([]Result, len(tasks))
	var next atomic.Int64
	var halt atomic.Bool
	var wg sync.WaitGroup
	for range min(LoadPool, len(tasks)) {
		wg.Go(func() {
			for !halt.Load() && ctx.Err() == nil {
				i := int(next.Add(1) - 1)
				if i >= len(tasks) {
					return
				}
				r := l.Enqueue(tasks[i])
				results[i] = r
				done.Add(1)
				if !r.Outcome.InRedis() {
					halt.Store(true)
				}
			}
		})
	}
	wg.Wait()
	return results
}

// Enqueue enqueues t and says what became of it. It takes no context: a
// call cut short after it was sent would leave its task uncertain for
// nothing.
func (l *Loader) Enqueue(t Task) Result {
	if l.shards != nil {
		t = l.spread.Task(t, l.shards(t.Queue))
	}
	probe := &writeProbe{}
	ctx := context.WithValue(context.Background(), probeKey{}, probe)
	info, err := l.client.EnqueueContext(ctx, t.Asynq, t.Opts...)
	switch {
	case err == nil:
		return Result{Outcome: Enqueued, ID: info.ID}
	case errors.Is(err, asynq.ErrTaskIDConflict):
		return Result{Outcome: Existed, ID: t.TaskID}
	case errors.Is(err, asynq.ErrDuplicateTask):
		return Result{Outcome: Duplicate}
	case probe.uncertain():
		return Result{Outcome: Uncertain, Err: err}
	}
	return Result{Outcome: Refused, Err: err}
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

// The bounds of one batch of Load: tasks are read from their input a
// batch at a time, so what a load holds does not grow with the input.
const (
	loadBatch      = 4096
	loadBatchBytes = 8 << 20 // of payloads
)

// Load enqueues the tasks next yields (ok false at the end), a batch at a
// time from LoadPool goroutines, and gives each task and its result to
// each, in order. The next batch is read while one loads, so the pool does
// not wait on the input. After a batch in which a task did not land, or
// once ctx is done, it tries no more: each gets the rest as NotTried. An
// error from next ends it, returned. done, if not nil, counts the tasks
// that have their result, for progress.
func (l *Loader) Load(ctx context.Context, next func() (t Task, ok bool, err error), done *atomic.Int64, each func(Task, Result)) error {
	if done == nil {
		done = new(atomic.Int64)
	}
	type batch struct {
		tasks []Task
		end   bool
		err   error
	}
	read := func() (b batch) {
		b.tasks = make([]Task, 0, loadBatch)
		for size := 0; len(b.tasks) < loadBatch && size < loadBatchBytes; {
			t, ok, err := next()
			if err != nil || !ok {
				b.end, b.err = true, err
				return b
			}
			b.tasks = append(b.tasks, t)
			size += len(t.Asynq.Payload())
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
		var results []Result
		if halted {
			results = make([]Result, len(b.tasks)) // all NotTried
		} else {
			results = l.load(ctx, b.tasks, done)
		}
		for i, r := range results {
			each(b.tasks[i], r)
			halted = halted || !r.Outcome.InRedis()
		}
		if b.end {
			return b.err
		}
	}
}
