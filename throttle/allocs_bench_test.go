package throttle_test

import (
	"context"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-redis/redis_rate/v10"
	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/internal/redistest"
	"github.com/sluicehq/sluice/throttle"
)

// BenchmarkAllowN runs AllowN on Redis for each algorithm, one round trip
// per call and as New makes it, and redis_rate's Allow beside them, from
// 50 goroutines on 10,000 keys as cmd/bench's throttle section does: for
// profiling the client's side of a decision (-benchmem, -cpuprofile); the
// figures to compare are cmd/bench's.
//
//	scripts/redis-env.sh go test -run - -bench AllowN -benchmem ./throttle/
func BenchmarkAllowN(b *testing.B) {
	rdb := redis.NewClient(&redis.Options{Addr: redistest.Addr(b), PoolSize: 50})
	b.Cleanup(func() { rdb.Close() })
	ctx := context.Background()
	keys := make([]string, 10_000)
	for i := range keys {
		keys[i] = "bench:" + strconv.Itoa(i)
	}
	for _, a := range throttle.Algorithms {
		for _, inFlight := range []int{0, 4} {
			lim, err := throttle.New(rdb, throttle.Spec{Algorithm: a, Limit: 100, Period: time.Second, Burst: 100, Windows: 10},
				throttle.WithPrefix(redistest.Prefix(b)), throttle.WithPipelining(inFlight))
			if err != nil {
				b.Fatal(err)
			}
			b.Run(string(a)+"/inflight="+strconv.Itoa(inFlight), func(b *testing.B) {
				var n atomic.Int64
				b.SetParallelism(25)
				b.RunParallel(func(pb *testing.PB) {
					for pb.Next() {
						if _, err := lim.AllowN(ctx, keys[n.Add(1)%int64(len(keys))], 1); err != nil {
							b.Error(err)
							return
						}
					}
				})
			})
		}
	}
	peer := redis_rate.NewLimiter(rdb)
	prefix := redistest.Prefix(b)
	b.Run("redis_rate", func(b *testing.B) {
		var n atomic.Int64
		b.SetParallelism(25)
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				if _, err := peer.Allow(ctx, prefix+keys[n.Add(1)%int64(len(keys))], redis_rate.PerSecond(100)); err != nil {
					b.Error(err)
					return
				}
			}
		})
	})
}
