package throttle

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/internal/redistest"
)

// TestLostPipelineReply (10.3): a pipeline of calls whose replies are lost
// is not sent again: each call is an error to its caller, and counted once.
func TestLostPipelineReply(t *testing.T) {
	ctx := context.Background()
	rdb, proxy := redistest.ProxiedClient(t)
	// go-redis keeps pipelines on connections of their own: open one, so
	// that what is lost is the pipeline's replies, not a handshake's.
	if _, err := rdb.Pipelined(ctx, func(p redis.Pipeliner) error { return p.Ping(ctx).Err() }); err != nil {
		t.Fatal(err)
	}
	g := newGate()
	rdb.AddHook(g)
	lim := gatedLimiter(t, rdb, 1)
	first := holdOne(t, g, lim)
	var failed atomic.Int64
	var wg sync.WaitGroup
	for range 10 {
		wg.Go(func() {
			if _, err := lim.AllowN(ctx, "k", 1); err != nil {
				failed.Add(1)
			}
		})
	}
	waitQueued(t, lim, 10)
	g.mu.Lock()
	g.beforeFirst = func() { proxy.LoseReplies(1) }
	g.mu.Unlock()
	close(g.release)
	wg.Wait()
	if <-first != 1 {
		t.Fatal("the first call, alone on the wire, was not admitted")
	}
	level, err := lim.Peek(ctx, "k")
	if err != nil {
		t.Fatal(err)
	}
	// 20 in the bucket: 1 taken by the first call, at most 10 by the
	// pipeline (the server may not have read all of it when the
	// connection broke).
	if failed.Load() != 10 || level.Remaining < 9 {
		t.Errorf("a pipeline of 10 calls whose replies were lost: %d failed, Remaining %d after; want 10 failed and at least 9 (1 taken before)", failed.Load(), level.Remaining)
	}
	if sent := g.sent(); len(sent) != 1 || len(sent[0]) != 10 {
		t.Errorf("pipelines sent: %v, want one of 10 calls", sent)
	}
}
