package redistest

import (
	"context"
	"net"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/internal/testkit"
)

// FailoverCluster is a Redis Cluster of the test's own: 3 masters with a replica
// each and a node timeout of 1s, so that a test may kill a master and see
// its replica take over (in about 2s), as in a failover.
type FailoverCluster struct {
	Nodes []*Server // the 6 nodes; which are masters changes with failovers
}

// nodeTimeout is the cluster's cluster-node-timeout: how long a master may
// be unreachable before its replica takes over.
const nodeTimeout = time.Second

// StartCluster starts the cluster's 6 redis-servers (no persistence) on
// free loopback ports, joins them, waits until every slot is served and
// every replica is in sync, and stops them when the test ends.
func StartCluster(tb testing.TB) *FailoverCluster {
	tb.Helper()
	c := &FailoverCluster{}
	var addrs []string
	// A client port and a cluster bus port for each node (the bus's
	// default, port+10000, could be any other server's port).
	ports := make([]string, 12)
	for i := range ports {
		ports[i] = strconv.Itoa(testkit.FreePort(tb))
	}
	for i, port := range ports[:6] {
		n := &Server{Addr: net.JoinHostPort("127.0.0.1", port), dir: tb.TempDir(), args: []string{
			"--appendonly", "no", "--cluster-enabled", "yes", "--repl-diskless-sync-delay", "0",
			"--cluster-port", ports[6+i], "--cluster-node-timeout", strconv.FormatInt(nodeTimeout.Milliseconds(), 10)}}
		n.Start(tb)
		tb.Cleanup(n.Kill)
		c.Nodes = append(c.Nodes, n)
		addrs = append(addrs, n.Addr)
	}
	out, err := exec.Command(redisCLI(tb), append(append([]string{"--cluster", "create"}, addrs...),
		"--cluster-replicas", "1", "--cluster-yes")...).CombinedOutput()
	if err != nil {
		tb.Fatalf("redis-cli --cluster create: %v\n%s", err, out)
	}
	c.WaitHealthy(tb)
	return c
}

// redisCLI is the redis-cli beside SLUICE_TEST_REDIS_SERVER, or on PATH.
func redisCLI(tb testing.TB) string {
	tb.Helper()
	cli := filepath.Join(filepath.Dir(env(tb, "SLUICE_TEST_REDIS_SERVER")), "redis-cli")
	if _, err := exec.LookPath(cli); err == nil {
		return cli
	}
	cli, err := exec.LookPath("redis-cli")
	if err != nil {
		tb.Fatalf("redis-cli is needed to make a cluster, and is neither beside redis-server nor on PATH: %v", err)
	}
	return cli
}

// Addrs are the addresses of the nodes, live or not.
func (c *FailoverCluster) Addrs() []string {
	addrs := make([]string, len(c.Nodes))
	for i, n := range c.Nodes {
		addrs[i] = n.Addr
	}
	return addrs
}

// Node is the node at addr, or nil.
func (c *FailoverCluster) Node(addr string) *Server {
	for _, n := range c.Nodes {
		if n.Addr == addr {
			return n
		}
	}
	return nil
}

// Client connects to the cluster, with go-redis's default options, and is
// closed when the test ends.
func (c *FailoverCluster) Client(tb testing.TB) *redis.ClusterClient {
	tb.Helper()
	rdb := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs()})
	ping(tb, rdb)
	return rdb
}

// WaitHealthy waits (up to 20s) until every live node says the cluster is
// ok, and every live replica is in sync with a live master.
func (c *FailoverCluster) WaitHealthy(tb testing.TB) {
	tb.Helper()
	ctx := context.Background()
	healthy := func() bool {
		for _, n := range c.Nodes {
			if !n.alive() {
				continue
			}
			rdb := redis.NewClient(&redis.Options{Addr: n.Addr, MaxRetries: -1})
			info, err := rdb.Info(ctx, "cluster", "replication").Result()
			state, _ := rdb.ClusterInfo(ctx).Result()
			rdb.Close()
			if err != nil || !strings.Contains(state, "cluster_state:ok") ||
				strings.Contains(info, "role:slave") && !strings.Contains(info, "master_link_status:up") {
				return false
			}
		}
		return true
	}
	deadline := time.Now().Add(20 * time.Second)
	for !healthy() {
		if time.Now().After(deadline) {
			tb.Fatal("the cluster is not healthy after 20s")
		}
		time.Sleep(50 * time.Millisecond)
	}
}
