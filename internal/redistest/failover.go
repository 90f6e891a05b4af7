package redistest

import (
	"context"
	"fmt"
	"net"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/internal/testkit"
)

// MasterOf is the node that a live node says serves key's slot now.
func (c *FailoverCluster) MasterOf(tb testing.TB, key string) *Server {
	tb.Helper()
	addr, err := c.masterOf(key)
	if err != nil {
		tb.Fatal(err)
	}
	for _, n := range c.Nodes {
		if n.Addr == addr {
			return n
		}
	}
	tb.Fatalf("the master of %q is %s, not a node of the cluster", key, addr)
	return nil
}

func (c *FailoverCluster) masterOf(key string) (string, error) {
	var live *Server
	for _, n := range c.Nodes {
		if n.alive() {
			live = n
			break
		}
	}
	if live == nil {
		return "", fmt.Errorf("no node of the cluster is live")
	}
	rdb := redis.NewClient(&redis.Options{Addr: live.Addr, MaxRetries: -1})
	defer rdb.Close()
	ctx := context.Background()
	slot, err := rdb.ClusterKeySlot(ctx, key).Result()
	if err != nil {
		return "", err
	}
	shards, err := rdb.ClusterShards(ctx).Result()
	if err != nil {
		return "", err
	}
	for _, shard := range shards {
		for _, r := range shard.Slots {
			if slot < r.Start || slot > r.End {
				continue
			}
			for _, n := range shard.Nodes {
				if n.Role == "master" && n.Health == "online" {
					return net.JoinHostPort(n.IP, strconv.FormatInt(n.Port, 10)), nil
				}
			}
		}
	}
	return "", fmt.Errorf("no node serves slot %d of %q", slot, key)
}

// WaitPromoted waits (up to 30 s) until a live node other than dead
// serves key's slot, then until the cluster is healthy (WaitHealthy), and
// returns when it saw the first.
func (c *FailoverCluster) WaitPromoted(tb testing.TB, key string, dead *Server) time.Time {
	tb.Helper()
	testkit.WaitFor(tb, 30*time.Second, "a replica to take over from "+dead.Addr, func() bool {
		addr, err := c.masterOf(key)
		return err == nil && addr != dead.Addr
	})
	promoted := time.Now()
	c.WaitHealthy(tb)
	return promoted
}
