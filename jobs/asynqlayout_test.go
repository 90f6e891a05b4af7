package jobs

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/internal/redistest"
	"github.com/sluicehq/sluice/internal/testkit"
)

// TestWokenTaskFirst: a task back from its wait is taken before the
// queue's backlog (asynq itself would put it behind every task enqueued
// before it, and it would come late for its turn).
func TestWokenTaskFirst(t *testing.T) {
	queue := redistest.Queue(t, "q")
	s := newTestScheduler(t, Config{Queues: map[string]QueueConfig{queue: {}}})
	client := asynq.NewClient(asynq.RedisClientOpt{Addr: redistest.Addr(t)})
	defer client.Close()
	ctx := context.Background()
	for _, id := range []string{"retried", "scheduled"} {
		if _, err := client.Enqueue(asynq.NewTask("test:order", nil), asynq.Queue(queue), asynq.TaskID(id), asynq.ProcessIn(time.Hour)); err != nil {
			t.Fatal(err)
		}
	}
	// "retried" waits in the retry list, as a task on asynq's retry path does.
	if err := s.queues.ZAdd(ctx, asynqKeys(queue)+"retry", redis.Z{Score: float64(time.Now().Add(time.Hour).Unix()), Member: "retried"}).Err(); err != nil {
		t.Fatal(err)
	}
	s.queues.ZRem(ctx, asynqKeys(queue)+"scheduled", "retried")
	s.queues.HSet(ctx, asynqKeys(queue)+"t:retried", "state", "retry")
	for i := range 20 {
		if _, err := client.Enqueue(asynq.NewTask("test:order", nil), asynq.Queue(queue), asynq.TaskID(fmt.Sprint("backlog-", i))); err != nil {
			t.Fatal(err)
		}
	}
	for _, id := range []string{"retried", "scheduled"} {
		if err := s.waker.note(ctx, queue, id, 0, time.Time{}); err != nil {
			t.Fatal(err)
		}
	}
	s.waker.wakeQueue(ctx, queue)

	var order []string
	done := make(chan struct{})
	mux := asynq.NewServeMux()
	mux.HandleFunc("test:order", func(ctx context.Context, task *asynq.Task) error {
		id, _ := asynq.GetTaskID(ctx)
		order = append(order, id)
		if len(order) == 22 {
			close(done)
		}
		return nil
	})
	srv := asynq.NewServer(asynq.RedisClientOpt{Addr: redistest.Addr(t)}, asynq.Config{Concurrency: 1, Queues: map[string]int{queue: 1}, LogLevel: asynq.WarnLevel})
	if err := srv.Start(mux); err != nil {
		t.Fatal(err)
	}
	defer srv.Shutdown()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatalf("only %d of 22 tasks ran", len(order))
	}
	if first := order[:2]; !(first[0] == "retried" && first[1] == "scheduled" || first[0] == "scheduled" && first[1] == "retried") {
		t.Errorf("tasks ran in the order %v; want the two woken ones first", order)
	}
}

// TestAsynqKeyLayout pins what lua/ready.lua and the orphan rescue assume
// of asynq's keys, against the asynq of go.mod: a queue's keys share the
// hash tag {queue}; pending is a list that asynq takes from its right end;
// scheduled, retry and archived are sorted sets of task IDs; each task is
// a hash at t:<id> whose field state names where it is, and pending_since
// is when it became pending, in ns.
func TestAsynqKeyLayout(t *testing.T) {
	ctx := context.Background()
	queue := redistest.Queue(t, "layout")
	rdb := redistest.Client(t)
	opt := asynq.RedisClientOpt{Addr: redistest.Addr(t)}
	client := asynq.NewClient(opt)
	defer client.Close()
	inspector := asynq.NewInspector(opt)
	defer inspector.Close()
	keys := asynqKeys(queue)
	for _, c := range []struct{ id, state string }{{"first", "pending"}, {"second", "pending"}, {"later", "scheduled"}, {"gone", "archived"}} {
		opts := []asynq.Option{asynq.Queue(queue), asynq.TaskID(c.id)}
		if c.state == "scheduled" {
			opts = append(opts, asynq.ProcessIn(time.Hour))
		}
		if _, err := client.Enqueue(asynq.NewTask("test:layout", nil), opts...); err != nil {
			t.Fatal(err)
		}
		if c.state == "archived" {
			if err := inspector.ArchiveTask(queue, c.id); err != nil {
				t.Fatal(err)
			}
		}
		if got := rdb.HGet(ctx, keys+"t:"+c.id, "state").Val(); got != c.state {
			t.Errorf("%st:%s state = %q, want %q", keys, c.id, got, c.state)
		}
	}
	if got := rdb.LRange(ctx, keys+"pending", 0, -1).Val(); fmt.Sprint(got) != "[second first]" {
		t.Errorf("%spending = %v, want [second first]: asynq pushes on the left and takes from the right", keys, got)
	}
	if since, err := rdb.HGet(ctx, keys+"t:first", "pending_since").Int64(); err != nil || time.Since(time.Unix(0, since)).Abs() > time.Minute {
		t.Errorf("%st:first pending_since = %d (%v), want now in ns", keys, since, err)
	}
	for set, id := range map[string]string{"scheduled": "later", "archived": "gone"} {
		if err := rdb.ZScore(ctx, keys+set, id).Err(); err != nil {
			t.Errorf("%s%s has no %s: %v", keys, set, id, err)
		}
	}
	if typ := rdb.Type(ctx, keys+"retry").Val(); typ != "none" && typ != "zset" {
		t.Errorf("%sretry is a %s, want a sorted set", keys, typ)
	}
	// asynq's own reading agrees: the two pending, one scheduled, one
	// archived.
	info, err := inspector.GetQueueInfo(queue)
	if err != nil || info.Pending != 2 || info.Scheduled != 1 || info.Archived != 1 {
		t.Errorf("asynq's queue info %+v, %v; want 2 pending, 1 scheduled, 1 archived", info, err)
	}
}

// TestQueueSizes: QueueSizes counts what asynq's own inspector counts for
// a queue with tasks pending and scheduled.
func TestQueueSizes(t *testing.T) {
	t.Parallel()
	queue := redistest.Queue(t, "sizes")
	opt := asynq.RedisClientOpt{Addr: redistest.Addr(t)}
	client := asynq.NewClient(opt)
	defer client.Close()
	for i := range 5 {
		opts := []asynq.Option{asynq.Queue(queue)}
		if i >= 3 {
			opts = append(opts, asynq.ProcessIn(time.Hour))
		}
		if _, err := client.Enqueue(asynq.NewTask("test:sizes", nil), opts...); err != nil {
			t.Fatal(err)
		}
	}
	rdb := redis.NewClient(&redis.Options{Addr: redistest.Addr(t)})
	defer rdb.Close()
	sizes, err := QueueSizes(context.Background(), rdb, queue)
	if err != nil {
		t.Fatal(err)
	}
	inspector := asynq.NewInspector(opt)
	defer inspector.Close()
	info, err := inspector.GetQueueInfo(queue)
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]int64{"pending": int64(info.Pending), "active": int64(info.Active), "scheduled": int64(info.Scheduled), "retry": int64(info.Retry)}
	if fmt.Sprint(sizes) != fmt.Sprint(want) || sizes["pending"] != 3 || sizes["scheduled"] != 2 {
		t.Errorf("QueueSizes: %v, want asynq's %v (3 pending, 2 scheduled)", sizes, want)
	}
}

// TestServerQueuesAsAsynqKeepsThem: the queues read from a live server's
// info (fleetSize's count of the servers that share a queue) are those the
// server was started with, as asynq's own Inspector reads them.
func TestServerQueuesAsAsynqKeepsThem(t *testing.T) {
	a, b := redistest.Queue(t, "a"), redistest.Queue(t, "b~1.x")
	srv := asynq.NewServer(asynq.RedisClientOpt{Addr: redistest.Addr(t)}, asynq.Config{Queues: map[string]int{a: 3, b: 1}, LogLevel: asynq.WarnLevel})
	if err := srv.Start(asynq.NewServeMux()); err != nil {
		t.Fatal(err)
	}
	defer srv.Shutdown()
	inspector := asynq.NewInspector(asynq.RedisClientOpt{Addr: redistest.Addr(t)})
	defer inspector.Close()
	var servers []*asynq.ServerInfo
	testkit.WaitFor(t, 5*time.Second, "the server's first heartbeat", func() bool {
		var err error
		if servers, err = inspector.Servers(); err != nil {
			t.Fatal(err)
		}
		return slices.ContainsFunc(servers, func(info *asynq.ServerInfo) bool { return info.Queues[a] == 3 })
	})
	rdb := redistest.Client(t)
	found := false
	for _, info := range servers {
		data, err := rdb.Get(context.Background(), fmt.Sprintf("asynq:servers:{%s:%d:%s}", info.Host, info.PID, info.ID)).Bytes()
		if err != nil {
			t.Fatal(err)
		}
		got, err := serverQueues(data)
		if err != nil {
			t.Fatal(err)
		}
		slices.Sort(got)
		if want := slices.Sorted(maps.Keys(info.Queues)); !slices.Equal(got, want) {
			t.Errorf("server %s: read queues %q, asynq's Inspector %q", info.ID, got, want)
		}
		found = found || slices.Equal(got, slices.Sorted(slices.Values([]string{a, b})))
	}
	if !found {
		t.Errorf("no server read as serving %q and %q among %d", a, b, len(servers))
	}
	if _, err := serverQueues([]byte{0x2a, 0x05, 0x0a}); err == nil {
		t.Error("a truncated info read without an error")
	}
}
