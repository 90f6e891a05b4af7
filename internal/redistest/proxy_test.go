package redistest

import (
	"context"
	"testing"

	"github.com/redis/go-redis/v9"
)

// TestProxyLosesReplies: what the fault tests rest on. A command whose
// reply the proxy loses ran on the server, and go-redis, with its default
// options, sends it again unasked, on one server and on a cluster: an INCR
// counts twice and says nothing.
func TestProxyLosesReplies(t *testing.T) {
	ctx := context.Background()
	standalone, proxy := ProxiedClient(t)
	cluster, proxies := ProxiedCluster(t)
	key := Prefix(t) + "n"
	master, err := cluster.MasterForKey(ctx, key)
	if err != nil {
		t.Fatal(err)
	}
	for name, c := range map[string]struct {
		rdb   redis.UniversalClient
		proxy *Proxy
	}{"redis": {standalone, proxy}, "cluster": {cluster, proxies[master.Options().Addr]}} {
		t.Run(name, func(t *testing.T) {
			if err := c.rdb.Set(ctx, key, 0, 0).Err(); err != nil {
				t.Fatal(err)
			}
			c.proxy.LoseReplies(1)
			n, err := c.rdb.Incr(ctx, key).Result()
			if err != nil || n != 2 || c.proxy.Lost() != 1 {
				t.Fatalf("one INCR with its reply lost: %d, %v, %d replies lost; want go-redis to send it again: 2, no error, 1 lost", n, err, c.proxy.Lost())
			}
		})
	}
}
