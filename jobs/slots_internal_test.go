package jobs

import (
	"context"
	"testing"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/internal/redistest"
	"github.com/sluicehq/sluice/throttle"
)

// TestAmbiguousAcquireReleased (10.5): an Acquire whose reply was lost may
// have taken the slot. The task gives it back before it goes back to Redis
// to ask again, rather than leave it taken for a lease nobody renews.
func TestAmbiguousAcquireReleased(t *testing.T) {
	ctx := context.Background()
	proxy := redistest.NewProxy(t, redistest.Addr(t))
	// No retries: go-redis would send the Acquire again, and learn what it
	// did (it is keyed by its holder).
	rdb := redis.NewClient(&redis.Options{Addr: proxy.Addr, MaxRetries: -1})
	t.Cleanup(func() { rdb.Close() })
	queue := redistest.Queue(t, "q")
	cfg := Config{Queues: map[string]QueueConfig{queue: {Concurrency: 1}}}
	s := newScheduler(t, rdb, cfg)
	if err := rdb.Ping(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	proxy.LoseReplies(1)
	slots, retryIn := s.takeSlots(ctx, s.gates.Load(), refOf(ctx, queue, "", asynq.NewTask("test:record", nil)))
	if slots != nil || retryIn != redisRetry {
		t.Fatalf("takeSlots after an Acquire without reply: %v, ask again in %v; want the task back in Redis, asking again in %v", slots, retryIn, redisRetry)
	}
	holders, err := redistest.Client(t).ZRange(ctx, throttle.Key("sluice:concurrency:", "queue:"+queue), 0, -1).Result()
	if err != nil {
		t.Fatal(err)
	}
	if proxy.Lost() != 1 || len(holders) != 0 {
		t.Fatalf("%d replies lost; slot held by %v after; want 1 lost, and the slot free", proxy.Lost(), holders)
	}
}
