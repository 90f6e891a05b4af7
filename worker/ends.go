package worker

import (
	"context"
	"errors"

	"github.com/redis/go-redis/v9"
)

// keepEnds is the hook of asynq's client in the worker. asynq 0.26 writes
// a task's end (done, retry, archive) once and, when that fails (Redis
// down, failing over, restarting), retries it every 5 s until the task's
// lease ends, but with the context of the first attempt, which it has
// cancelled by then: every retry fails at once, the task stays active
// until its lease has run out and then runs again, or is archived. A
// command this client is given with a context already cancelled (on
// asynq's client, those retries are the ones) runs with the context's
// values but not its cancellation, under go-redis's own timeouts, so the
// end lands once Redis is back.
type keepEnds struct{}

func (keepEnds) DialHook(next redis.DialHook) redis.DialHook { return next }

func (keepEnds) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error { return next(uncancelled(ctx), cmd) }
}

func (keepEnds) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error { return next(uncancelled(ctx), cmds) }
}

// uncancelled is ctx, or without its cancellation if it is cancelled.
func uncancelled(ctx context.Context) context.Context {
	if errors.Is(ctx.Err(), context.Canceled) {
		return context.WithoutCancel(ctx)
	}
	return ctx
}

var _ redis.Hook = keepEnds{}
