package worker

import (
	"context"
	"errors"
	"net"
	"sync/atomic"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
)

// settleWindow is how long after a failure to reach Redis every task's
// end waits until the task's own key answers (see settler).
const settleWindow = 10 * time.Second

// settler holds back the end of a task (its result, on its way to asynq)
// while Redis may not take it. asynq v0.26 writes a task's end (done,
// retry, archive) once; when that write fails it means to retry it, but
// with a context it has already cancelled, so every retry fails and the
// task stays active until its lease runs out and asynq runs it again. A
// task that ends while its queue's Redis (in a cluster, the master of
// its slot) is down, failing over or loading would run twice, or be
// archived. So for settleWindow after a client of the worker failed to
// reach Redis, a task's end first reads its own key on asynq's client (the
// one that will write the end, so the same cluster map), and waits while
// that fails for want of Redis, up to the task's own deadline. Otherwise
// it costs nothing.
type settler struct {
	rdb         redis.UniversalClient // asynq's client
	lastFailure atomic.Int64          // Unix ns of the last failure to reach Redis that a hooked client saw
}

// Middleware waits, after next, until Redis can take the task's end (see
// settler).
func (s *settler) Middleware(next asynq.Handler) asynq.Handler {
	return asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) error {
		err := next.ProcessTask(ctx, t)
		if time.Since(time.Unix(0, s.lastFailure.Load())) < settleWindow {
			s.wait(ctx)
		}
		return err
	})
}

// wait reads the task's key until Redis answers (a reply, even an error
// that is not about its availability), or ctx ends.
func (s *settler) wait(ctx context.Context) {
	queue, _ := asynq.GetQueueName(ctx)
	id, _ := asynq.GetTaskID(ctx)
	// asynq's key of the task: in its queue's slot, which its end writes.
	key := "asynq:{" + queue + "}:t:" + id
	for pause := 50 * time.Millisecond; ; pause = min(2*pause, time.Second) {
		if err := s.rdb.Exists(ctx, key).Err(); !unavailable(err) {
			return
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(pause):
		}
	}
}

// watch notes the failures of rdb, which must not have been used yet: on
// a cluster, each node's dials too, since the cluster's own hooks see a
// command fail only once go-redis has tried it again on other nodes.
func (s *settler) watch(rdb redis.UniversalClient) {
	h := settleHook{s}
	rdb.AddHook(h)
	if c, ok := rdb.(*redis.ClusterClient); ok {
		c.OnNewNode(func(node *redis.Client) { node.AddHook(h) })
	}
}

type settleHook struct{ s *settler }

func (h settleHook) note(err error) {
	if unavailable(err) {
		h.s.lastFailure.Store(time.Now().UnixNano())
	}
}

func (h settleHook) DialHook(next redis.DialHook) redis.DialHook {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		conn, err := next(ctx, network, addr)
		h.note(err)
		return conn, err
	}
}

func (h settleHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		h.note(err)
		return err
	}
}

func (h settleHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		err := next(ctx, cmds)
		h.note(err)
		for _, cmd := range cmds {
			h.note(cmd.Err())
		}
		return err
	}
}

// unavailable reports whether err says that Redis could not be reached or
// could not serve (down, failing over, loading), as opposed to nil or a
// reply about the command (redis.Nil, NOSCRIPT, ...). A context the
// caller cancelled says nothing about Redis.
func unavailable(err error) bool {
	if err == nil || errors.Is(err, context.Canceled) {
		return false
	}
	var reply redis.Error
	if !errors.As(err, &reply) {
		return true
	}
	for _, prefix := range []string{"CLUSTERDOWN", "TRYAGAIN", "LOADING", "MASTERDOWN", "READONLY"} {
		if redis.HasErrorPrefix(err, prefix) {
			return true
		}
	}
	return false
}
