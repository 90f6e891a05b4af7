package config

import (
	"context"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/internal/redistest"
)

// TestClusterClientFailover: a cluster client of Client (and so of
// AsynqOpt) reaches a key again within 2 s of its master's replica
// being promoted, where go-redis by itself keeps dialling the dead master
// until its map is a minute old.
func TestClusterClientFailover(t *testing.T) {
	c := redistest.StartCluster(t)
	rdb := Redis{Cluster: c.Addrs()}.Client()
	defer rdb.Close()
	ctx := context.Background()
	const key = "{failover}:key"
	if err := rdb.Set(ctx, key, "v", 0).Err(); err != nil {
		t.Fatal(err)
	}
	plain := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs()})
	defer plain.Close()
	if err := plain.Get(ctx, key).Err(); err != nil {
		t.Fatal(err)
	}
	// Replication is asynchronous: the replica must have the key before
	// its master dies.
	master := c.MasterOf(t, key)
	node := redis.NewClient(&redis.Options{Addr: master.Addr})
	replicas, err := node.Wait(ctx, 1, 5*time.Second).Result()
	node.Close()
	if err != nil || replicas != 1 {
		t.Fatalf("WAIT 1: %d replicas, %v", replicas, err)
	}
	master.Kill()
	promoted := c.WaitPromoted(t, key, master)
	for rdb.Get(ctx, key).Err() != nil {
		if time.Since(promoted) > 2*time.Second {
			t.Fatalf("Get(%s) still fails 2 s after the promotion: %v", key, rdb.Get(ctx, key).Err())
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Logf("Client's read the key %v after the promotion; go-redis's own cluster client, then: %v",
		time.Since(promoted).Round(time.Millisecond), plain.Get(ctx, key).Err())
}
