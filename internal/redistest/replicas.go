package redistest

import (
	"context"
	"fmt"
	"net"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/internal/testkit"
)

// ReplicaCluster is a Redis Cluster of a test's own: 3 masters with one
// replica each, so that a test may kill a master and have its replica
// promoted, as in a failover. Built with CLUSTER commands (no redis-cli).
type ReplicaCluster struct {
	Nodes []*Server // masters first, then their replicas in the same order; roles change with failovers
}

// replicaNodeTimeout is the cluster-node-timeout: how long a master must
// be unreachable before its replica takes over, about 1.5 times that
// later. Shorter would fail over masters that the shared CPUs of a test
// run merely slowed.
const replicaNodeTimeout = 2 * time.Second

// StartReplicaCluster starts 6 redis-servers (no persistence) on free
// loopback ports, makes them a cluster of 3 masters and 3 replicas, waits
// until every node says the cluster is ok and every replica is in sync,
// and stops them when the test ends.
func StartReplicaCluster(tb testing.TB) *ReplicaCluster {
	tb.Helper()
	c := &ReplicaCluster{}
	ports := freePorts(tb, 12) // a client port and a cluster bus port for each node
	buses := ports[6:]
	for i, port := range ports[:6] {
		n := &Server{Addr: net.JoinHostPort("127.0.0.1", port), dir: tb.TempDir(), args: []string{
			"--appendonly", "no", "--cluster-enabled", "yes", "--cluster-port", buses[i],
			"--cluster-node-timeout", strconv.FormatInt(replicaNodeTimeout.Milliseconds(), 10),
			"--repl-diskless-sync", "yes", "--repl-diskless-sync-delay", "0"}}
		n.Start(tb)
		tb.Cleanup(n.Kill)
		c.Nodes = append(c.Nodes, n)
	}
	ctx := context.Background()
	clients := make([]*redis.Client, len(c.Nodes))
	ids := make([]string, len(c.Nodes))
	for i, n := range c.Nodes {
		clients[i] = redis.NewClient(&redis.Options{Addr: n.Addr})
		defer clients[i].Close()
		id, err := clients[i].ClusterMyID(ctx).Result()
		if err != nil {
			tb.Fatalf("CLUSTER MYID on %s: %v", n.Addr, err)
		}
		ids[i] = id
	}
	const slots = 16384
	for i := range 3 {
		if err := clients[i].ClusterAddSlotsRange(ctx, i*slots/3, (i+1)*slots/3-1).Err(); err != nil {
			tb.Fatalf("CLUSTER ADDSLOTSRANGE on %s: %v", c.Nodes[i].Addr, err)
		}
	}
	for i, n := range c.Nodes[1:] {
		host, port, _ := net.SplitHostPort(n.Addr)
		// The bus port too: it is not port+10000 here.
		if err := clients[0].Do(ctx, "CLUSTER", "MEET", host, port, buses[i+1]).Err(); err != nil {
			tb.Fatalf("CLUSTER MEET %s: %v", n.Addr, err)
		}
	}
	// A node can replicate a master only once it knows it.
	testkit.WaitFor(tb, 20*time.Second, "every node to know the others", func() bool {
		for _, rdb := range clients {
			nodes, err := rdb.ClusterNodes(ctx).Result()
			if err != nil || strings.Count(nodes, "\n") < len(clients) || strings.Contains(nodes, "handshake") {
				return false
			}
		}
		return true
	})
	for i := range 3 {
		if err := clients[3+i].ClusterReplicate(ctx, ids[i]).Err(); err != nil {
			tb.Fatalf("CLUSTER REPLICATE on %s: %v", c.Nodes[3+i].Addr, err)
		}
	}
	c.WaitHealthy(tb)
	return c
}

// freePorts are n different loopback ports that were free a moment ago:
// all held open at once, so that no two are the same.
func freePorts(tb testing.TB, n int) []string {
	tb.Helper()
	ports := make([]string, n)
	for i := range ports {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			tb.Fatal(err)
		}
		defer ln.Close()
		_, ports[i], _ = net.SplitHostPort(ln.Addr().String())
	}
	return ports
}

// Addrs are the nodes' addresses, live or not.
func (c *ReplicaCluster) Addrs() []string {
	addrs := make([]string, len(c.Nodes))
	for i, n := range c.Nodes {
		addrs[i] = n.Addr
	}
	return addrs
}

// live are the nodes not killed.
func (c *ReplicaCluster) live() []*Server {
	return slices.DeleteFunc(slices.Clone(c.Nodes), func(n *Server) bool { return n.cmd == nil || n.cmd.ProcessState != nil })
}

// MasterOf is the node that a live node says serves key's slot now.
func (c *ReplicaCluster) MasterOf(tb testing.TB, key string) *Server {
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

func (c *ReplicaCluster) masterOf(key string) (string, error) {
	live := c.live()
	if len(live) == 0 {
		return "", fmt.Errorf("no node of the cluster is live")
	}
	rdb := redis.NewClient(&redis.Options{Addr: live[0].Addr, MaxRetries: -1})
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

// WaitPromoted waits (up to 30 s) until a live node other than dead serves
// key's slot and every live node says the cluster is ok, and returns
// when it saw that.
func (c *ReplicaCluster) WaitPromoted(tb testing.TB, key string, dead *Server) time.Time {
	tb.Helper()
	testkit.WaitFor(tb, 30*time.Second, "a replica to take over from "+dead.Addr, func() bool {
		addr, err := c.masterOf(key)
		return err == nil && addr != dead.Addr && c.healthy(false)
	})
	return time.Now()
}

// WaitHealthy waits (up to 20 s) until every live node says the cluster is
// ok and every live replica is in sync with its master.
func (c *ReplicaCluster) WaitHealthy(tb testing.TB) {
	tb.Helper()
	testkit.WaitFor(tb, 20*time.Second, "the cluster to be healthy", func() bool { return c.healthy(true) })
}

func (c *ReplicaCluster) healthy(synced bool) bool {
	ctx := context.Background()
	for _, n := range c.live() {
		rdb := redis.NewClient(&redis.Options{Addr: n.Addr, MaxRetries: -1})
		state, err := rdb.ClusterInfo(ctx).Result()
		repl, rerr := rdb.Info(ctx, "replication").Result()
		rdb.Close()
		if err != nil || rerr != nil || !strings.Contains(state, "cluster_state:ok") ||
			synced && strings.Contains(repl, "role:slave") && !strings.Contains(repl, "master_link_status:up") {
			return false
		}
	}
	return true
}
