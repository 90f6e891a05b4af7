package jobs

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// fleetDeps is what every service of the fleet's housekeeping takes: the
// waker, the block board, the orphan rescue. Each has a run(ctx) that
// Scheduler.Run starts and awaits.
type fleetDeps struct {
	rdb    redis.UniversalClient // the limits' Redis
	queues redis.UniversalClient // asynq's Redis
	clock  schedClock
	log    *slog.Logger
	worker string          // this process, the holder of a service's claims and leases
	gates  func() *gateSet // the config in force
}

// service is one of the loops that keep a worker's view of the fleet
// fresh: it runs until ctx ends and has stopped when run returns.
type service interface {
	run(ctx context.Context)
}

// runAll runs every service until ctx ends and returns once all of them
// have returned.
func runAll(ctx context.Context, services ...service) {
	var wg sync.WaitGroup
	for _, svc := range services {
		wg.Go(func() { svc.run(ctx) })
	}
	wg.Wait()
}

// changeWork runs the work a config change leaves behind (the rebooking
// of tasks booked at an old rate) on Run's context, and Run awaits it: a
// change does not outlive the worker.
type changeWork struct {
	mu  sync.Mutex
	ctx context.Context // Run's while it runs, else nil
	wg  sync.WaitGroup
}

// changeWorkAlone bounds the work of a change made while Run is not
// running: it is done before Apply returns.
const changeWorkAlone = 5 * time.Second

// open starts taking work on ctx.
func (c *changeWork) open(ctx context.Context) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.ctx = ctx
}

// close stops taking work and waits for the work under way.
func (c *changeWork) close() {
	c.mu.Lock()
	c.ctx = nil
	c.mu.Unlock()
	c.wg.Wait()
}

// do runs work in the background on Run's context, or, while Run is not
// running, before it returns, for up to changeWorkAlone.
func (c *changeWork) do(work func(ctx context.Context)) {
	c.mu.Lock()
	ctx := c.ctx
	if ctx != nil {
		c.wg.Go(func() { work(ctx) })
	}
	c.mu.Unlock()
	if ctx == nil {
		alone, cancel := context.WithTimeout(context.Background(), changeWorkAlone)
		defer cancel()
		work(alone)
	}
}
