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

// tally counts the results by outcome.
func tally(results []result) map[outcome]int {
	n := map[outcome]int{}
	for _, r := range results {
		n[r.outcome]++
	}
	return n
}

// spans writes the positions of the tasks that match as ranges,
// "1-500, 502, 504-600": tasks that follow each other in tasks are one
// range, whatever lies between their lines (blank lines).
func spans(tasks []task, match func(i int) bool) string {
	var b strings.Builder
	for i := 0; i < len(tasks); i++ {
		if !match(i) {
			continue
		}
		j := i
		for j+1 < len(tasks) && match(j+1) {
			j++
		}
		if b.Len() > 0 {
			b.WriteString(", ")
		}
		b.WriteString(strconv.Itoa(tasks[i].line))
		if j > i {
			fmt.Fprintf(&b, "-%d", tasks[j].line)
		}
		i = j
	}
	return b.String()
}
