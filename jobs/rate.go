package jobs

import (
	"context"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// Each worker adds the tasks it completed to per-queue buckets of
// rateBucket in Redis, so that anyone (enqueue status) can read a queue's
// fleet-wide rate over the last minute.
const (
	rateBucket  = 10 * time.Second
	rateBuckets = 6 // a minute
)

// rateRecorder adds this worker's completions to the queues' rate
// buckets every rateFlush, and once more when its run ends.
type rateRecorder struct {
	fleetDeps
	rateCounter
}

// rateFlush is how often a worker adds its completions to the rates.
const rateFlush = 5 * time.Second

func (r *rateRecorder) run(ctx context.Context) {
	tick := time.NewTicker(rateFlush)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			r.flush(context.WithoutCancel(ctx), r.rdb)
			return
		case <-tick.C:
		}
		if err := r.flush(ctx, r.rdb); err != nil && ctx.Err() == nil {
			r.log.Warn("cannot record the queues' rates", "err", err)
		}
	}
}

// rateCounter counts completions per queue in this worker between flushes.
type rateCounter struct {
	mu     sync.Mutex
	counts map[string]int64
}

func (r *rateCounter) add(queue string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.counts == nil {
		r.counts = map[string]int64{}
	}
	r.counts[queue]++
}

// flush adds the counts to the current bucket of each queue.
func (r *rateCounter) flush(ctx context.Context, rdb redis.UniversalClient) error {
	r.mu.Lock()
	counts := r.counts
	r.counts = nil
	r.mu.Unlock()
	if len(counts) == 0 {
		return nil
	}
	bucket := time.Now().Unix() / int64(rateBucket/time.Second)
	pipe := rdb.Pipeline()
	for queue, n := range counts {
		key := rateKey(queue, bucket)
		pipe.IncrBy(ctx, key, n)
		pipe.Expire(ctx, key, 2*rateBuckets*rateBucket)
	}
	_, err := pipe.Exec(ctx)
	return err
}

// RecentRate returns the tasks per second the fleet completed in queue over
// the last minute (the six whole buckets before the current one).
func RecentRate(ctx context.Context, rdb redis.UniversalClient, queue string) (float64, error) {
	current := time.Now().Unix() / int64(rateBucket/time.Second)
	total := 0.0
	for b := current - rateBuckets; b < current; b++ {
		n, err := rdb.Get(ctx, rateKey(queue, b)).Float64()
		if err != nil && err != redis.Nil {
			return 0, err
		}
		total += n
	}
	return total / (rateBuckets * rateBucket).Seconds(), nil
}
