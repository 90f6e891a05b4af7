package jobs

import (
	"context"
	"errors"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
	"google.golang.org/protobuf/encoding/protowire"
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

// fleetSize counts the live workers of the fleet, whose number divides a
// limit among them for the local policy (throttle.Divide): asynq's live
// servers that serve one of this worker's queues. Servers of other fleets
// on the same Redis, on queues of their own, draw nothing from its limits
// and are not counted. The count is 0, not known, until this worker has
// been registered long enough for the others to count it too: until then
// the local policy denies, and tasks wait in Redis (a worker that counted
// itself alone would admit the whole limit beside workers started with
// it).
type fleetSize struct {
	queues redis.UniversalClient // asynq's Redis
	served func() []string       // the queues this worker serves
	self   string                // this process in asynq's server keys: "{host:pid:"
	n      atomic.Int64
	// run's own:
	joined  time.Time       // when a count first saw this process
	ours    string          // served, as countSharing last classified the servers for it
	sharing map[string]bool // live server key -> it serves one of ours
}

func newFleetSize(queues redis.UniversalClient, served func() []string) *fleetSize {
	return &fleetSize{queues: queues, served: served, self: "{" + asynqHost() + ":" + strconv.Itoa(os.Getpid()) + ":", sharing: map[string]bool{}}
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
	if now.Sub(f.joined) < fleetSettle {
		return
	}
	if n, err := f.countSharing(ctx, live); err == nil {
		f.n.Store(int64(n))
	}
}

// countSharing counts the servers among live that serve one of this worker's
// queues. What a server serves is fixed for its life: it is read once, from
// the info asynq keeps for it, so a steady fleet costs no read but the
// count's own.
func (f *fleetSize) countSharing(ctx context.Context, live []string) (int, error) {
	served := f.served()
	if ours := strings.Join(served, "\x00"); ours != f.ours {
		f.ours, f.sharing = ours, map[string]bool{}
	}
	var unknown []string
	for _, key := range live {
		if _, ok := f.sharing[key]; !ok {
			unknown = append(unknown, key)
		}
	}
	infos := make([]*redis.StringCmd, len(unknown))
	if len(unknown) > 0 {
		_, err := f.queues.Pipelined(ctx, func(p redis.Pipeliner) error {
			for i, key := range unknown {
				infos[i] = p.Get(ctx, key)
			}
			return nil
		})
		if err != nil && !errors.Is(err, redis.Nil) {
			return 0, err
		}
	}
	for i, key := range unknown {
		info, err := infos[i].Bytes()
		if errors.Is(err, redis.Nil) {
			continue // gone since the count: not counted, and looked at again if still listed
		}
		if err != nil {
			return 0, err // the last count stands
		}
		queues, err := serverQueues(info)
		// Info this asynq version cannot read: counted, as a worker
		// that shares is (the twins smaller, never larger).
		f.sharing[key] = err != nil || slices.ContainsFunc(queues, func(q string) bool { return slices.Contains(served, q) })
	}
	n := 0
	kept := make(map[string]bool, len(live))
	for _, key := range live {
		if shares, ok := f.sharing[key]; ok {
			kept[key] = shares
			if shares {
				n++
			}
		}
	}
	f.sharing = kept
	return n, nil
}

// serverQueues reads the queues a server serves from the info asynq keeps
// for it (asynq v0.26: a ServerInfo message, whose field 5 is the map of
// its queues to their priorities, an entry a message of key 1 and value 2).
func serverQueues(info []byte) ([]string, error) {
	var queues []string
	for len(info) > 0 {
		num, typ, n := protowire.ConsumeTag(info)
		if n < 0 {
			return nil, protowire.ParseError(n)
		}
		info = info[n:]
		if num != 5 || typ != protowire.BytesType {
			if n = protowire.ConsumeFieldValue(num, typ, info); n < 0 {
				return nil, protowire.ParseError(n)
			}
			info = info[n:]
			continue
		}
		entry, n := protowire.ConsumeBytes(info)
		if n < 0 {
			return nil, protowire.ParseError(n)
		}
		info = info[n:]
		for len(entry) > 0 {
			num, typ, n := protowire.ConsumeTag(entry)
			if n < 0 {
				return nil, protowire.ParseError(n)
			}
			entry = entry[n:]
			if num == 1 && typ == protowire.BytesType {
				name, n := protowire.ConsumeString(entry)
				if n < 0 {
					return nil, protowire.ParseError(n)
				}
				queues = append(queues, name)
				break
			}
			if n = protowire.ConsumeFieldValue(num, typ, entry); n < 0 {
				return nil, protowire.ParseError(n)
			}
			entry = entry[n:]
		}
	}
	return queues, nil
}
