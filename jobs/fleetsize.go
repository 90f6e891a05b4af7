package jobs

import (
	"context"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
)

const (
	// fleetEvery is how often a worker counts the fleet: a worker that
	// joins is counted by the others within it.
	fleetEvery = time.Second
	// fleetSettle is how long after a worker first sees itself among the
	// fleet's servers it starts to trust its count: by then every other
	// worker has counted it too (a count comes every fleetEvery), and it
	// has counted every worker that started before it.
	fleetSettle = 2 * fleetEvery
	// asynqServers is asynq's set of live servers (v0.26: base.AllServers),
	// each scored by when its last heartbeat expires, in Unix seconds.
	asynqServers = "asynq:servers"
)

// fleetSize counts the live workers of the fleet (asynq's servers), whose
// number divides a limit among them for the local policy (throttle.Divide).
// The count is 0, not known, until this worker has been registered long
// enough for the others to count it too: until then the local policy
// denies, and tasks wait in Redis (a worker that counted itself alone would
// admit the whole limit beside workers started with it).
type fleetSize struct {
	queues redis.UniversalClient // asynq's Redis
	self   string                // this process in asynq's server keys: "{host:pid:"
	n      atomic.Int64
	joined time.Time // when a count first saw this process; run's own
}

func newFleetSize(queues redis.UniversalClient) *fleetSize {
	return &fleetSize{queues: queues, self: "{" + asynqHost() + ":" + strconv.Itoa(os.Getpid()) + ":"}
}

// asynqHost is the host name asynq registers its servers under.
func asynqHost() string {
	host, err := os.Hostname()
	if err != nil {
		return "unknown-host" // as asynq's NewServer does
	}
	return host
}

// shares is the number of live workers, 0 while it is not known.
func (f *fleetSize) shares() int { return int(f.n.Load()) }

// run counts the fleet every fleetEvery until ctx ends. A count that
// fails keeps the last one.
func (f *fleetSize) run(ctx context.Context) {
	for {
		f.count(ctx)
		select {
		case <-ctx.Done():
			return
		case <-time.After(fleetEvery):
		}
	}
}

func (f *fleetSize) count(ctx context.Context) {
	now := time.Now() // asynq scores its servers on the system clock
	live, err := f.queues.ZRangeByScore(ctx, asynqServers, &redis.ZRangeBy{Min: strconv.FormatInt(now.Unix(), 10), Max: "+inf"}).Result()
	if err != nil {
		return
	}
	if f.joined.IsZero() {
		if !slices.ContainsFunc(live, func(key string) bool { return strings.Contains(key, f.self) }) {
			return
		}
		f.joined = now
	}
	if now.Sub(f.joined) >= fleetSettle {
		f.n.Store(int64(len(live)))
	}
}
