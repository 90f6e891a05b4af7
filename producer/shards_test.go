package producer_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/internal/redistest"
	"github.com/sluicehq/sluice/producer"
	"github.com/sluicehq/sluice/throttle"
)

// TestShardQueues: shard i of N is named "q~i" or "q~i.k", its slot in
// the middle half of the i-th N-th of the slot space (so 3 shards land
// on 3 masters of a cluster made by redis-cli), the same on every call;
// LogicalQueue reads the name back; one shard is the queue itself.
func TestShardQueues(t *testing.T) {
	for _, queue := range []string{"emails", "a", "test-testshardedqueue-d9369dc94fb2-sharded", "Bulk:import.v2"} {
		for _, n := range []int{2, 3, 7, 64} {
			names := producer.ShardQueues(queue, n)
			if len(names) != n {
				t.Fatalf("ShardQueues(%q, %d) has %d names", queue, n, len(names))
			}
			for i, name := range names {
				if want := fmt.Sprintf("%s~%d", queue, i); name != want && !strings.HasPrefix(name, want+".") {
					t.Errorf("shard %d of %q is %q, want %s or %s.<k>", i, queue, name, want, want)
				}
				lo, hi := i*16384/n, (i+1)*16384/n
				if s := throttle.Slot(name); s < lo+(hi-lo)/4 || s >= hi-(hi-lo)/4 {
					t.Errorf("shard %d of %d, %q, is in slot %d, outside the middle half of [%d, %d)", i, n, name, s, lo, hi)
				}
				if q, got := producer.LogicalQueue(name); q != queue || got != i {
					t.Errorf("LogicalQueue(%q) = %q, %d; want %q, %d", name, q, got, queue, i)
				}
				if again := producer.ShardQueue(queue, n, i); again != name {
					t.Errorf("ShardQueue(%q, %d, %d) = %q, then %q", queue, n, i, name, again)
				}
			}
		}
	}
	if got := producer.ShardQueues("emails", 1); len(got) != 1 || got[0] != "emails" {
		t.Errorf("ShardQueues(emails, 1) = %q, want [emails]", got)
	}
	for _, name := range []string{"emails", "a~b", "a~01", "a~-1", "a~64"} {
		if q, i := producer.LogicalQueue(name); q != name || i != -1 {
			t.Errorf("LogicalQueue(%q) = %q, %d; want it as no shard", name, q, i)
		}
	}
}

// TestSpread: Spread gives a sharded queue's tasks to its shards in turn;
// a task with an id, or unique, to the same shard each time; a queue of
// one shard keeps its name. A Loader told the shard counts spreads what
// it loads over the shards on Redis (standalone and cluster).
func TestSpread(t *testing.T) {
	var s producer.Spread
	counts := map[string]int{}
	for range 300 {
		counts[s.Queue("emails", 3)]++
	}
	for _, name := range producer.ShardQueues("emails", 3) {
		if counts[name] != 100 {
			t.Errorf("300 tasks over 3 shards: %v, want 100 each", counts)
			break
		}
	}
	if q := s.Queue("emails", 1); q != "emails" {
		t.Errorf("a queue of one shard: %q, want emails", q)
	}
	check := payloads(t)
	withID, _ := producer.Options{TaskID: ptr("order-7")}.Check(func(k string) string { return k }, time.Now())
	unique, _ := producer.Options{Unique: ptr("1m")}.Check(func(k string) string { return k }, time.Now())
	for _, o := range []producer.CheckedOptions{withID, unique} {
		task, err := producer.NewTask("demo:noop", nil, "emails", o, check)
		if err != nil {
			t.Fatal(err)
		}
		first := s.Task(task, 3).Shard
		for range 10 {
			if again := s.Task(task, 3); again.Shard != first || again.Queue != "emails" {
				t.Fatalf("the same task went to %q (queue %q), then to %q, want one shard", first, again.Queue, again.Shard)
			}
		}
	}

	onBothBackends(t, testSpreadLoad)
}

func testSpreadLoad(t *testing.T, rdb redis.UniversalClient, opt asynq.RedisConnOpt) {
	queue := redistest.Queue(t, "spread")
	const tasks = 90
	inspector := asynq.NewInspector(opt)
	defer inspector.Close()
	shards := producer.ShardQueues(queue, 3)
	t.Cleanup(func() {
		for _, q := range shards {
			inspector.DeleteQueue(q, true)
		}
	})
	task, err := producer.NewTask("demo:noop", nil, queue, producer.CheckedOptions{}, payloads(t))
	if err != nil {
		t.Fatal(err)
	}
	loader := producer.NewLoader(rdb)
	loader.SpreadOver(func(q string) int {
		if q == queue {
			return 3
		}
		return 1
	})
	n := 0
	err = loader.Load(context.Background(), func() (producer.Task, bool, error) {
		n++
		return task, n <= tasks, nil
	}, nil, func(producer.Task, producer.Result) {})
	if err != nil {
		t.Fatal(err)
	}
	for _, q := range shards {
		if info, err := inspector.GetQueueInfo(q); err != nil || info.Pending != tasks/3 {
			t.Errorf("shard %s: %+v %v, want %d pending", q, info, err, tasks/3)
		}
	}
	if qs, _ := inspector.Queues(); slices.Contains(qs, queue) {
		t.Errorf("the logical queue %s has tasks of its own: asynq lists it", queue)
	}
}
