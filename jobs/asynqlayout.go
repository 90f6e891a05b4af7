// asynq v0.26's key layout, which sluice reads and writes directly where
// asynq's API cannot do it cheaply: lua/ready.lua moves a task to the head
// of pending, and the orphan rescue counts the archived. asynqlayout_test.go
// pins it against the asynq version in go.mod.

package jobs

import (
	"context"
	"fmt"

	"github.com/redis/go-redis/v9"
)

// asynqKeys is the prefix of queue's keys in asynq v0.26's layout
// (internal/base), for what its API cannot do cheaply.
func asynqKeys(queue string) string { return "asynq:{" + queue + "}:" }

// QueueStates are the states of a queue's tasks that QueueSizes counts.
var QueueStates = []string{"pending", "active", "scheduled", "retry"}

// QueueSizes returns how many of queue's tasks asynq holds in each of
// QueueStates, read in one round trip (the keys share the queue's hash
// tag). Tasks waiting in Redis for their turn are among the retry and
// scheduled ones (see WaitingTask).
func QueueSizes(ctx context.Context, rdb redis.UniversalClient, queue string) (map[string]int64, error) {
	k := asynqKeys(queue)
	pipe := rdb.Pipeline()
	cmds := []*redis.IntCmd{pipe.LLen(ctx, k+"pending"), pipe.LLen(ctx, k+"active"), pipe.ZCard(ctx, k+"scheduled"), pipe.ZCard(ctx, k+"retry")}
	if _, err := pipe.Exec(ctx); err != nil {
		return nil, fmt.Errorf("jobs: sizes of queue %q: %w", queue, err)
	}
	sizes := make(map[string]int64, len(cmds))
	for i, c := range cmds {
		sizes[QueueStates[i]] = c.Val()
	}
	return sizes, nil
}
