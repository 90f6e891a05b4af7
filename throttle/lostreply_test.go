package throttle_test

import (
	"context"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/internal/redistest"
	"github.com/sluicehq/sluice/internal/testkit"
	"github.com/sluicehq/sluice/throttle"
)

// lossyPair is two limiters on the same state: lossy reaches Redis through
// a proxy that can lose replies, with go-redis's default options (3
// retries), as most callers build their clients; direct is a plain client
// that tells what the state holds.
type lossyPair struct {
	lossy, direct throttle.Reserver
	// loseNext makes the proxy in front of key's server lose its next reply.
	loseNext func(t *testing.T)
}

// forEachLossy runs body as a subtest with a lossyPair on key "k" of a
// limit of 10 per hour, for every algorithm on the standalone server and on
// the cluster.
func forEachLossy(t *testing.T, body func(t *testing.T, p lossyPair)) {
	for _, a := range throttle.Algorithms {
		spec := throttle.Spec{Algorithm: a, Limit: 10, Period: time.Hour}
		for name, p := range lossyPairs(t, spec, "k") {
			t.Run(name+"/"+string(a), func(t *testing.T) { body(t, p) })
		}
	}
}

// lossyPairs builds a lossyPair of spec for key on the standalone server
// and on the cluster, on a manual clock at t0.
func lossyPairs(t *testing.T, spec throttle.Spec, key string) map[string]lossyPair {
	t.Helper()
	ctx := context.Background()
	prefix := redistest.Prefix(t)
	clock := testkit.NewClock(t0)
	pair := func(lossy, direct redis.UniversalClient, proxy *redistest.Proxy) lossyPair {
		var p lossyPair
		for _, c := range []struct {
			rdb redis.UniversalClient
			lim *throttle.Reserver
		}{{lossy, &p.lossy}, {direct, &p.direct}} {
			lim, err := throttle.New(c.rdb, spec, throttle.WithPrefix(prefix), throttle.WithClock(clock))
			if err != nil {
				t.Fatal(err)
			}
			*c.lim = lim
		}
		p.loseNext = func(t *testing.T) {
			t.Helper()
			// A connection to the key's server is open and idle: what is lost
			// is the next call's reply, not a handshake's.
			if _, err := p.lossy.Peek(ctx, key); err != nil {
				t.Fatal(err)
			}
			proxy.LoseReplies(1)
		}
		return p
	}
	standalone, proxy := redistest.ProxiedClient(t)
	cluster, proxies := redistest.ProxiedCluster(t)
	master, err := cluster.MasterForKey(ctx, throttle.Key(prefix, key))
	if err != nil {
		t.Fatal(err)
	}
	return map[string]lossyPair{
		"redis":   pair(standalone, redistest.Client(t), proxy),
		"cluster": pair(cluster, redistest.Cluster(t), proxies[master.Options().Addr]),
	}
}

// TestLostReplyCountsOnce (10.3): a call that ran on the server but whose
// reply was lost (the connection broke in between) is an error to its
// caller, and is counted once: go-redis must not send it again.
func TestLostReplyCountsOnce(t *testing.T) {
	ctx := context.Background()
	forEachLossy(t, func(t *testing.T, p lossyPair) {
		p.loseNext(t)
		_, err := p.lossy.AllowN(ctx, "k", 1)
		level, perr := p.direct.Peek(ctx, "k")
		if perr != nil {
			t.Fatal(perr)
		}
		if counted := 10 - level.Remaining; err == nil || counted != 1 {
			t.Fatalf("one AllowN whose reply was lost: error %v, counted %d; want an error, and 1 counted", err, counted)
		}
	})
}

// TestLostCancelReply (10.3): reserve 5, reserve 3, then give the 5 back
// with a Cancel whose reply is lost. The Cancel is an error to its caller
// and gives back once: the window then admits 7 more, 10 in all.
func TestLostCancelReply(t *testing.T) {
	ctx := context.Background()
	forEachLossy(t, func(t *testing.T, p lossyPair) {
		var first throttle.Reservation
		for _, n := range []int{5, 3} {
			r, err := p.lossy.ReserveN(ctx, "k", n, 0)
			if err != nil || !r.OK {
				t.Fatalf("ReserveN(%d) = %+v, %v; want OK", n, r, err)
			}
			if n == 5 {
				first = r
			}
		}
		p.loseNext(t)
		err := p.lossy.Cancel(ctx, "k", first)
		more := 0
		for ; more < 20; more++ {
			if d, err := p.direct.AllowN(ctx, "k", 1); err != nil || !d.Allowed {
				break
			}
		}
		if err == nil || 3+more != 10 {
			t.Fatalf("a Cancel whose reply was lost: error %v, then %d more admitted, %d events in the window; want an error, and 10 events", err, more, 3+more)
		}
	})
}
