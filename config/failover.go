package config

import (
	"context"
	"net"

	"github.com/redis/go-redis/v9"
)

// newClusterClient is a Redis Cluster client that reloads the cluster's
// map (CLUSTER SLOTS) whenever a node cannot be dialled. go-redis reloads
// it on MOVED and ASK, which only a live node sends, and otherwise once a
// minute: after a failover it would keep dialling the dead master for up
// to a minute after its replica took over, and every command of that
// master's slots would fail meanwhile. Reloads are coalesced by go-redis
// (one at a time, 200 ms apart), so a dead node costs a few CLUSTER SLOTS
// a second until the map no longer names it; a live cluster costs none.
func newClusterClient(opt *redis.ClusterOptions) *redis.ClusterClient {
	c := redis.NewClusterClient(opt)
	c.OnNewNode(func(node *redis.Client) { node.AddHook(reloadOnDialFailure{c}) })
	return c
}

// reloadOnDialFailure is the hook of each node's client (see
// newClusterClient).
type reloadOnDialFailure struct{ cluster *redis.ClusterClient }

func (h reloadOnDialFailure) DialHook(next redis.DialHook) redis.DialHook {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		conn, err := next(ctx, network, addr)
		if err != nil {
			h.cluster.ReloadState(ctx)
		}
		return conn, err
	}
}

func (reloadOnDialFailure) ProcessHook(next redis.ProcessHook) redis.ProcessHook { return next }

func (reloadOnDialFailure) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// clusterConnOpt is the asynq.RedisConnOpt of a cluster: asynq's clients
// are Client's.
type clusterConnOpt struct{ r Redis }

// MakeRedisClient returns a new *redis.ClusterClient, as Client does.
func (o clusterConnOpt) MakeRedisClient() any { return o.r.Client() }
