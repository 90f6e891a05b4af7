package jobs

import (
	"context"
	"fmt"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/internal/redistest"
	"github.com/sluicehq/sluice/internal/testkit"
)

// TestRunAwaitsItsServices: Run returns only once every service it started
// has returned, and the work of a config change made while it ran (the
// rebooking) with them, even when Redis is slow to answer what they still
// do (the waker resigns, the rebooking claims its change): once it
// returns, no goroutine runs any of them, so the Scheduler may be closed.
func TestRunAwaitsItsServices(t *testing.T) {
	queue := redistest.Queue(t, "q")
	quota := redistest.Queue(t, "api")
	cfgOf := func(limit int) Config {
		return Config{
			Queues: map[string]QueueConfig{queue: {Drain: &LimitConfig{Limit: 50, Period: time.Second}}},
			Quotas: map[string]LimitConfig{quota: {Limit: limit, Period: time.Second}},
			Tasks:  map[string]TaskConfig{"test:call": {Quotas: []string{quota}}},
		}
	}
	// Redis slow to answer once the test says so: what a service still
	// does when Run is told to stop takes that long.
	rdb := redistest.Client(t)
	slow := &slowHook{}
	rdb.AddHook(slow)
	s := newScheduler(t, rdb, cfgOf(10))
	ctx, cancel := context.WithCancel(context.Background())
	returned := make(chan struct{})
	go func() {
		defer close(returned)
		s.Run(ctx)
	}()
	services := []string{"(*waker).run", "(*blockBoard).takeBlocks", "(*orphanRescue).run", "(*rateRecorder).run", "(*fleetSize).run"}
	testkit.WaitFor(t, 5*time.Second, "every service to run", func() bool {
		stacks := string(stackOf(true))
		for _, svc := range services {
			if !strings.Contains(stacks, "jobs."+svc) {
				return false
			}
		}
		return true
	})
	slow.on.Store(true)
	if err := s.Apply(cfgOf(20)); err != nil {
		t.Fatal(err)
	}
	cancel()
	select {
	case <-returned:
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not return within 10s of its context ending")
	}
	// A goroutine that has said it is done (closed a channel, called
	// wg.Done) may still be on its way out: it is given 5ms to leave.
	left := ours(s)
	for i := 0; i < 5 && len(left) > 0; i++ {
		time.Sleep(time.Millisecond)
		left = ours(s)
	}
	for _, g := range left {
		t.Errorf("a goroutine of the Scheduler still runs after Run returned:\n%s", g)
	}
}

// ours are the stacks of the goroutines that run code of s (its services
// show their receivers' addresses) or that this goroutine started (as its
// cancel starts a context.AfterFunc), in package jobs; not those of other
// tests, waiting in t.Parallel or leaving.
func ours(s *Scheduler) []string {
	marks := []string{}
	for _, p := range []any{s, s.waker, s.board, s.rescuer, s.rates, s.fleet} {
		marks = append(marks, fmt.Sprintf("(%p", p))
	}
	self, _, _ := strings.Cut(strings.TrimPrefix(string(stackOf(false)), "goroutine "), " ")
	marks = append(marks, "in goroutine "+self+"\n")
	var found []string
	for _, g := range strings.Split(string(stackOf(true)), "\n\n") {
		if !strings.Contains(g, "sluice/jobs.(*") || strings.HasPrefix(g, "goroutine "+self+" ") {
			continue
		}
		for _, m := range marks {
			if strings.Contains(g+"\n", m) {
				found = append(found, g)
				break
			}
		}
	}
	return found
}

// stackOf is the stack of this goroutine, or of every goroutine, taken at
// once.
func stackOf(all bool) []byte {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, all)
		if n < len(buf) {
			return buf[:n]
		}
		buf = make([]byte, 2*len(buf))
	}
}

// slowHook delays every command by slowAnswer once on is set.
type slowHook struct{ on atomic.Bool }

const slowAnswer = 200 * time.Millisecond

func (h *slowHook) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *slowHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if h.on.Load() {
			time.Sleep(slowAnswer)
		}
		return next(ctx, cmd)
	}
}
func (h *slowHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		if h.on.Load() {
			time.Sleep(slowAnswer)
		}
		return next(ctx, cmds)
	}
}
