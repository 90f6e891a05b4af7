package throttle

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/algorithms"
	"github.com/sluicehq/sluice/internal/redistest"
	"github.com/sluicehq/sluice/internal/testkit"
)

// gate holds the first script call a client sends until release is closed,
// and records every pipeline of script calls the client sends.
type gate struct {
	holding atomic.Bool
	held    chan struct{} // closed once the first script call is held
	release chan struct{}

	mu          sync.Mutex
	pipelines   [][]string // the commands' names, per pipeline
	beforeFirst func()     // if set, runs before the first pipeline goes out
}

func newGate() *gate { return &gate{held: make(chan struct{}), release: make(chan struct{})} }

func (g *gate) DialHook(next redis.DialHook) redis.DialHook { return next }

func (g *gate) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if scriptCall(cmd.Name()) {
			// Not a sync.Once: its other callers would wait for the held one.
			if g.holding.CompareAndSwap(false, true) {
				close(g.held)
				<-g.release
			}
		}
		return next(ctx, cmd)
	}
}

func (g *gate) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		names := make([]string, len(cmds))
		for i, c := range cmds {
			names[i] = c.Name()
		}
		// go-redis sends CLIENT SETINFO on new connections in pipelines.
		if !scriptCall(names[0]) {
			return next(ctx, cmds)
		}
		g.mu.Lock()
		g.pipelines = append(g.pipelines, names)
		before := g.beforeFirst
		g.beforeFirst = nil
		g.mu.Unlock()
		if before != nil {
			before()
		}
		return next(ctx, cmds)
	}
}

// scriptCall tells whether a command is a limiter's call: a function's or
// a script's.
func scriptCall(name string) bool {
	return name == "fcall" || strings.HasPrefix(name, "eval")
}

func (g *gate) sent() [][]string {
	g.mu.Lock()
	defer g.mu.Unlock()
	return slices.Clone(g.pipelines)
}

// gatedClient is a client with a gate on it.
type gatedClient struct {
	rdb  redis.UniversalClient
	gate *gate
}

// gatedClients are a standalone and a cluster client, each with a gate.
func gatedClients(t *testing.T) map[string]gatedClient {
	clients := map[string]gatedClient{}
	for name, rdb := range map[string]redis.UniversalClient{
		"redis":   redis.NewClient(&redis.Options{Addr: redistest.Addr(t)}),
		"cluster": redis.NewClusterClient(&redis.ClusterOptions{Addrs: redistest.ClusterAddrs(t)}),
	} {
		t.Cleanup(func() { rdb.Close() })
		g := newGate()
		rdb.AddHook(g)
		clients[name] = gatedClient{rdb, g}
	}
	return clients
}

// waitQueued waits until n calls of lim wait for a round trip.
func waitQueued(t *testing.T, lim *redisLimiter, n int) {
	t.Helper()
	testkit.WaitFor(t, 10*time.Second, fmt.Sprintf("%d calls waiting for a round trip", n), func() bool {
		lim.calls.mu.Lock()
		defer lim.calls.mu.Unlock()
		return len(lim.calls.waiting) == n
	})
}

// waitIdle waits until lim has no round trip out: the last one hands back
// its slot a moment after its callers have their answers.
func waitIdle(t *testing.T, lim *redisLimiter) {
	t.Helper()
	testkit.WaitFor(t, 10*time.Second, "no round trip in flight", func() bool {
		lim.calls.mu.Lock()
		defer lim.calls.mu.Unlock()
		return lim.calls.inFlight == 0
	})
}

func gatedLimiter(t *testing.T, rdb redis.UniversalClient, inFlight int) *redisLimiter {
	t.Helper()
	spec := Spec{Algorithm: TokenBucket, Limit: 20, Period: time.Second}
	lim, err := New(rdb, spec, WithPrefix(redistest.Prefix(t)), WithClock(testkit.NewClock(time.Unix(1_800_000_000, 0))), WithPipelining(inFlight))
	if err != nil {
		t.Fatal(err)
	}
	return lim.(*redisLimiter)
}

// allowAll makes calls concurrent AllowN calls on one key and returns how
// many were admitted.
func allowAll(t *testing.T, lim Limiter, calls int) int {
	t.Helper()
	var wg sync.WaitGroup
	allowed := make(chan bool, calls)
	for range calls {
		wg.Go(func() {
			d, err := lim.AllowN(context.Background(), "k", 1)
			if err != nil {
				t.Errorf("AllowN: %v", err)
			}
			allowed <- d.Allowed
		})
	}
	wg.Wait()
	close(allowed)
	n := 0
	for a := range allowed {
		if a {
			n++
		}
	}
	return n
}

// holdOne starts one AllowN call and returns once the gate holds it; the
// channel gives 1 if it was admitted, once the gate is released.
func holdOne(t *testing.T, g *gate, lim *redisLimiter) chan int {
	first := make(chan int, 1)
	go func() { first <- allowAll(t, lim, 1) }()
	<-g.held
	return first
}

// holdFirst holds one AllowN call on the wire, then starts queued more and
// waits until they all wait for a round trip. The channels give how many of
// each were admitted once the gate is released.
func holdFirst(t *testing.T, g *gate, lim *redisLimiter, queued int) (first, rest chan int) {
	t.Helper()
	first, rest = holdOne(t, g, lim), make(chan int, 1)
	go func() { rest <- allowAll(t, lim, queued) }()
	waitQueued(t, lim, queued)
	return first, rest
}

// While the one round trip allowed is out, 30 more calls queue; they all go
// out in one pipeline, and every decision is still its own atomic run:
// exactly the bucket's 20 are admitted.
func TestCallsWaitingShareOnePipeline(t *testing.T) {
	for name, c := range gatedClients(t) {
		t.Run(name, func(t *testing.T) {
			lim := gatedLimiter(t, c.rdb, 1)
			first, rest := holdFirst(t, c.gate, lim, 30)
			close(c.gate.release)
			if got := <-first + <-rest; got != 20 {
				t.Errorf("admitted %d of 31 calls, want the bucket's 20", got)
			}
			sent := c.gate.sent()
			if len(sent) != 1 || len(sent[0]) != 30 {
				t.Errorf("pipelines sent: %v, want one of 30 calls", sent)
			}
			waitIdle(t, lim)
		})
	}
}

// A pipeline that finds the script cache flushed (or, where it runs as a
// function, the functions) runs its calls again once the script or the
// function is back: no decision fails. On a server of its own: on the
// shared ones, another package's tests could load them again between the
// flush and the pipeline.
func TestPipelineAfterScriptFlush(t *testing.T) {
	for _, tc := range []struct {
		desc    string
		scripts bool // run as scripts (EVALSHA), as on Redis 6
		flush   func(ctx context.Context, rdb *redis.Client) error
		want    [][]string
	}{
		{"scripts", true, func(ctx context.Context, rdb *redis.Client) error { return rdb.ScriptFlush(ctx).Err() },
			[][]string{slices.Repeat([]string{"evalsha"}, 10), slices.Repeat([]string{"eval"}, 10)}},
		{"functions", false, func(ctx context.Context, rdb *redis.Client) error { return rdb.FunctionFlush(ctx).Err() },
			[][]string{slices.Repeat([]string{"fcall"}, 10), slices.Repeat([]string{"fcall"}, 10)}},
	} {
		t.Run(tc.desc, func(t *testing.T) {
			srv := redistest.StartServer(t)
			rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
			t.Cleanup(func() { rdb.Close() })
			if tc.scripts {
				algorithms.BookScript.ScriptsOnly(rdb)
			}
			g := newGate()
			rdb.AddHook(g)
			lim := gatedLimiter(t, rdb, 1)
			first, rest := holdFirst(t, g, lim, 10)
			// The first call, run alone, brings the script or function
			// back; the flush must come after it, just before the pipeline.
			flusher := redis.NewClient(&redis.Options{Addr: srv.Addr})
			t.Cleanup(func() { flusher.Close() })
			g.mu.Lock()
			g.beforeFirst = func() {
				if err := tc.flush(context.Background(), flusher); err != nil {
					t.Errorf("flush: %v", err)
				}
			}
			g.mu.Unlock()
			close(g.release)
			if got := <-first + <-rest; got != 11 {
				t.Errorf("admitted %d of 11 calls, want all", got)
			}
			if sent := g.sent(); !slices.EqualFunc(sent, tc.want, slices.Equal) {
				t.Errorf("pipelines sent: %v, want %v", sent, tc.want)
			}
		})
	}
}

// A call whose context ends while it waits for a round trip leaves the
// queue and counts nothing.
func TestWaitingCallGivesUp(t *testing.T) {
	c := gatedClients(t)["redis"]
	lim := gatedLimiter(t, c.rdb, 1)
	first := holdOne(t, c.gate, lim)
	ctx, cancel := context.WithCancel(context.Background())
	gaveUp := make(chan error)
	go func() {
		_, err := lim.AllowN(ctx, "k", 1)
		gaveUp <- err
	}()
	waitQueued(t, lim, 1)
	cancel()
	if err := <-gaveUp; !errors.Is(err, context.Canceled) {
		t.Errorf("AllowN with its context cancelled while waiting: %v, want context.Canceled", err)
	}
	waitQueued(t, lim, 0)
	close(c.gate.release)
	if got := <-first; got != 1 {
		t.Errorf("the first call was not admitted")
	}
	level, err := lim.Peek(context.Background(), "k")
	if err != nil {
		t.Fatal(err)
	}
	if level.Remaining != 19 {
		t.Errorf("after one admitted call and one withdrawn, Remaining = %d, want 19", level.Remaining)
	}
	if sent := c.gate.sent(); len(sent) != 0 {
		t.Errorf("pipelines sent: %v, want none", sent)
	}
}

// WithPipelining(0): every call goes out at once, alone.
func TestWithoutPipelining(t *testing.T) {
	c := gatedClients(t)["redis"]
	lim := gatedLimiter(t, c.rdb, 0)
	first := holdOne(t, c.gate, lim)
	// 30 calls finish while the first is held: none waits for it.
	if got := allowAll(t, lim, 30); got != 20 {
		t.Errorf("admitted %d of 30 calls, want the bucket's 20", got)
	}
	close(c.gate.release)
	if got := <-first; got != 0 {
		t.Errorf("the held call, run after the bucket emptied, was admitted")
	}
	if sent := c.gate.sent(); len(sent) != 0 {
		t.Errorf("pipelines sent: %v, want none", sent)
	}
	if _, err := New(c.rdb, Spec{Algorithm: TokenBucket, Limit: 1, Period: time.Second}, WithPipelining(-1)); !errors.Is(err, ErrInvalidSpec) {
		t.Errorf("WithPipelining(-1): %v, want ErrInvalidSpec", err)
	}
}
