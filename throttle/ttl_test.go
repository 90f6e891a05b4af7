package throttle_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/internal/redistest"
	"github.com/sluicehq/sluice/throttle"
)

// TestRedisClockAndTTL runs on Redis's own clock (no clock injected): every
// key a decision writes must expire no sooner than its ResetAfter and no
// later than the next millisecond after it, and a key must land in the
// cluster slot of its escaped tag whatever braces it contains.
func TestRedisClockAndTTL(t *testing.T) {
	ctx := context.Background()
	for _, target := range []struct {
		name string
		rdb  redis.UniversalClient
	}{{"redis", redistest.Client(t)}, {"cluster", redistest.Cluster(t)}} {
		for _, a := range throttle.Algorithms {
			t.Run(target.name+"/"+string(a), func(t *testing.T) {
				prefix := redistest.Prefix(t)
				lim, err := throttle.New(target.rdb, throttle.Spec{Algorithm: a, Limit: 3, Period: 10 * time.Second, Burst: 3}, throttle.WithPrefix(prefix))
				if err != nil {
					t.Fatal(err)
				}
				for key, tag := range map[string]string{"plain": "plain", "x}{y": "x%7D%7By", "{tag}": "%7Btag%7D"} {
					start := time.Now()
					d, err := lim.AllowN(ctx, key, 3)
					if err != nil || !d.Allowed {
						t.Fatalf("AllowN(%q, 3) = %+v, %v", key, d, err)
					}
					if d, err := lim.AllowN(ctx, key, 1); err != nil || d.Allowed || d.RetryAfter <= 0 || d.RetryAfter > 10*time.Second {
						t.Fatalf("AllowN(%q, 1) on a full key = %+v, %v; want denied within 10s", key, d, err)
					}
					var mu sync.Mutex // ForEachMaster scans the masters concurrently
					var found []string
					scan := func(ctx context.Context, c *redis.Client) error {
						iter := c.Scan(ctx, 0, prefix+"*", 1000).Iterator()
						for iter.Next(ctx) {
							mu.Lock()
							found = append(found, iter.Val())
							mu.Unlock()
						}
						return iter.Err()
					}
					if c, ok := target.rdb.(*redis.ClusterClient); ok {
						err = c.ForEachMaster(ctx, scan)
					} else {
						err = scan(ctx, target.rdb.(*redis.Client))
					}
					// The hash tag is the escaped key alone, so the cluster slot
					// is the tag's, whatever braces the key holds.
					if want := prefix + "{" + tag + "}"; err != nil || len(found) != 1 || found[0] != want {
						t.Fatalf("keys under %q: %q, %v; want exactly %q", prefix, found, err, want)
					}
					ttl, err := target.rdb.PTTL(ctx, found[0]).Result()
					if err != nil {
						t.Fatal(err)
					}
					elapsed := time.Since(start)
					if ttl > d.ResetAfter+time.Millisecond || ttl < d.ResetAfter-elapsed-time.Millisecond {
						t.Fatalf("key %q: PTTL %v for ResetAfter %v (%v since the call)", found[0], ttl, d.ResetAfter, elapsed)
					}
					if err := target.rdb.Del(ctx, found[0]).Err(); err != nil {
						t.Fatal(err)
					}
				}
			})
		}
	}
}
