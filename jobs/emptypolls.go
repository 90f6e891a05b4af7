package jobs

import (
	"context"
	"strings"
	"sync"

	"github.com/redis/go-redis/v9"
)

// EmptyPolls is a go-redis hook for the client an asynq server runs on:
// it answers asynq's polls of an empty queue with a plain command instead
// of a script run. An idle asynq worker polls each of its queues about ten
// times a second (sluice sets asynq's TaskCheckInterval to 100ms so that a
// task comes soon after it is due) and looks at each queue's scheduled and
// retry sets every second; each poll runs a script (EVALSHA and two or
// three commands inside it) even when there is nothing to take. With the
// hook, a dequeue first asks LLEN of the queue's pending list, and a
// forward ZCOUNT of the set's due tasks; asynq's script runs only when
// there is something to do. A dequeue that found n tasks pending lets the
// next n-1 dequeues of the queue go straight to the script (until one
// finds it empty, as when other workers took them): a deep queue is not
// asked its length for every task, and a queue whose tasks come one at a
// time does not pay an empty script run after each. Its answer otherwise, and asynq's behaviour, are those of the script
// on an empty queue or set. A task that lands between the look and the
// script is taken by the next poll, as it would be if it had landed just
// after the script.
//
// The hook knows asynq v0.26's dequeue and forward scripts by their keys
// (asynqlayout.go; TestEmptyPolls pins them against the asynq of go.mod);
// any other command goes through untouched. Use one per client:
//
//	asynqRDB.AddHook(&jobs.EmptyPolls{})
type EmptyPolls struct {
	mu      sync.Mutex
	pending map[string]int64 // pending list key -> dequeues that may skip the look
}

func (*EmptyPolls) DialHook(next redis.DialHook) redis.DialHook { return next }

func (e *EmptyPolls) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		keys, argv := scriptCall(cmd)
		switch {
		case isDequeue(keys):
			if !e.skipLook(keys[0]) {
				look := redis.NewIntCmd(ctx, "llen", keys[0])
				if isEmpty(ctx, next, look) {
					return redis.Nil // the script's answer on an empty queue
				}
				e.found(keys[0], look.Val())
			}
			err := next(ctx, cmd)
			if err != nil {
				e.found(keys[0], 0) // empty (or failing): look first next time
			}
			return err
		case isForward(keys) && len(argv) > 0:
			// The script moves the tasks due by argv[0] (unix seconds)
			// and returns how many.
			if script, ok := cmd.(*redis.Cmd); ok && isEmpty(ctx, next, redis.NewIntCmd(ctx, "zcount", keys[0], "-inf", argv[0])) {
				script.SetVal(int64(0))
				return nil
			}
		}
		return next(ctx, cmd)
	}
}

// skipLook reports whether a dequeue of the pending list may skip its
// look, and counts it.
func (e *EmptyPolls) skipLook(pending string) bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.pending[pending] > 0 {
		e.pending[pending]--
		return true
	}
	return false
}

// found notes that the pending list had n tasks for this dequeue and the
// next n-1, bounded so that a huge list is still looked at now and then.
func (e *EmptyPolls) found(pending string, n int64) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.pending == nil {
		e.pending = map[string]int64{}
	}
	if n <= 1 {
		delete(e.pending, pending)
		return
	}
	e.pending[pending] = min(n-1, maxSkippedLooks)
}

// maxSkippedLooks bounds the dequeues that follow a look without one.
const maxSkippedLooks = 1000

func (*EmptyPolls) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next // asynq polls one command at a time
}

// isEmpty runs look, a count, and reports whether it found none. A failed
// look says nothing: the script runs and reports.
func isEmpty(ctx context.Context, next redis.ProcessHook, look *redis.IntCmd) bool {
	return next(ctx, look) == nil && look.Val() == 0
}

// scriptCall is an EVALSHA or EVAL command's keys and arguments, as
// go-redis lays them out: name, script or SHA, number of keys, keys, args.
func scriptCall(cmd redis.Cmder) (keys []string, argv []any) {
	if name := cmd.Name(); name != "evalsha" && name != "eval" {
		return nil, nil
	}
	args := cmd.Args()
	if len(args) < 3 {
		return nil, nil
	}
	n, ok := args[2].(int)
	if !ok || n < 0 || 3+n > len(args) {
		return nil, nil
	}
	keys = make([]string, n)
	for i := range n {
		if keys[i], ok = args[3+i].(string); !ok {
			return nil, nil
		}
	}
	return keys, args[3+n:]
}

// isDequeue: asynq's dequeue script's keys are the queue's pending list,
// paused flag, active list and lease set.
func isDequeue(keys []string) bool {
	return len(keys) == 4 && sameQueue(keys, "pending", "paused", "active", "lease")
}

// isForward: asynq's forward script's keys are the queue's scheduled or
// retry set and its pending list.
func isForward(keys []string) bool {
	return len(keys) == 2 && (sameQueue(keys, "scheduled", "pending") || sameQueue(keys, "retry", "pending"))
}

// sameQueue reports whether keys are, in order, one queue's asynq keys
// named names.
func sameQueue(keys []string, names ...string) bool {
	queue, ok := strings.CutSuffix(keys[0], "}:"+names[0])
	if !ok || !strings.HasPrefix(queue, "asynq:{") {
		return false
	}
	queue = strings.TrimPrefix(queue, "asynq:{")
	for i, name := range names {
		if keys[i] != asynqKeys(queue)+name {
			return false
		}
	}
	return true
}
