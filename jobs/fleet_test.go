package jobs

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
	"google.golang.org/protobuf/encoding/protowire"

	"github.com/sluicehq/sluice/internal/redistest"
	"github.com/sluicehq/sluice/internal/testkit"
)

// newScheduler is a Scheduler on cfg whose limits live on rdb, on the
// system clock unless opts give another, closed when the test ends.
func newScheduler(t *testing.T, rdb redis.UniversalClient, cfg Config, opts ...Option) *Scheduler {
	t.Helper()
	s, err := NewScheduler(rdb, asynq.RedisClientOpt{Addr: redistest.Addr(t)}, cfg,
		NewMetrics(prometheus.NewRegistry()), slog.New(slog.NewTextHandler(io.Discard, nil)), opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

// serve runs an asynq server of s's config on the test's Redis with mux
// (its middleware included) and returns a client of that Redis; both stop
// when the test ends.
func serve(t *testing.T, s *Scheduler, mux *asynq.ServeMux) *asynq.Client {
	t.Helper()
	srv := asynq.NewServer(asynq.RedisClientOpt{Addr: redistest.Addr(t)}, s.AsynqConfig())
	if err := srv.Start(mux); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Shutdown)
	client := asynq.NewClient(asynq.RedisClientOpt{Addr: redistest.Addr(t)})
	t.Cleanup(func() { client.Close() })
	return client
}

// newTestScheduler is newScheduler on the test's Redis.
func newTestScheduler(t *testing.T, cfg Config) *Scheduler {
	t.Helper()
	return newScheduler(t, redistest.Client(t), cfg)
}

// TestWorkerDeathCounts (9.6): the death of the worker running a task is
// counted as the task's failure (it spends a retry), while waiting is not;
// a task without retries that asynq archived after its worker died runs
// again once, and stays archived after a second death.
func TestWorkerDeathCounts(t *testing.T) {
	queue := redistest.Queue(t, "q")
	s := newTestScheduler(t, Config{Queues: map[string]QueueConfig{queue: {}}})
	isFailure := s.AsynqConfig().IsFailure
	if !isFailure(asynq.ErrLeaseExpired) {
		t.Error("a worker death is not counted: a task that kills its worker would run for ever")
	}
	if isFailure(&waitError{wait: time.Second}) || isFailure(errWaitInRedis) {
		t.Error("waiting for a turn counted as a failure")
	}
	// An archived task, as asynq leaves one whose worker died: archived
	// from the schedule (the same lists and state).
	client := asynq.NewClient(asynq.RedisClientOpt{Addr: redistest.Addr(t)})
	defer client.Close()
	info, err := client.Enqueue(asynq.NewTask("test:poison", nil), asynq.Queue(queue), asynq.MaxRetry(0), asynq.ProcessIn(time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	died := func() *asynq.TaskInfo {
		t.Helper()
		if err := s.inspector.ArchiveTask(queue, info.ID); err != nil {
			t.Fatal(err)
		}
		archived, err := s.inspector.GetTaskInfo(queue, info.ID)
		if err != nil {
			t.Fatal(err)
		}
		archived.LastErr = asynq.ErrLeaseExpired.Error()
		return archived
	}
	ctx := context.Background()
	if !s.rescuer.rescue(ctx, queue, died()) {
		t.Fatal("a task archived after one worker death was not run again")
	}
	if st, err := s.inspector.GetTaskInfo(queue, info.ID); err != nil || st.State != asynq.TaskStatePending {
		t.Fatalf("after a rescue the task is %v (%v), want pending", st.State, err)
	}
	again := died()
	if s.rescuer.rescue(ctx, queue, again) {
		t.Fatal("a task archived after a second worker death was run again")
	}
	if st, err := s.inspector.GetTaskInfo(queue, info.ID); err != nil || st.State != asynq.TaskStateArchived {
		t.Fatalf("after the second death the task is %v (%v), want archived", st.State, err)
	}
	withRetries := *again
	withRetries.ID = "another"
	withRetries.MaxRetry = 3
	if s.rescuer.rescue(ctx, queue, &withRetries) {
		t.Fatal("a task with retries, archived when they were spent on worker deaths, was run again")
	}
}

// TestOrphansOfEveryFleet: two fleets of different queues on one Redis
// (two services, or the tests of make test) each rescue their own
// orphans. The look for orphans was one claim for the whole server: while
// another fleet's worker held it (4 s of every 5), this fleet's orphans
// stayed archived (TestWorkerKilled found 6 of 200 tasks archived 170 s
// after a kill, with the package's other fleets on the server).
func TestOrphansOfEveryFleet(t *testing.T) {
	mine, theirs := redistest.Queue(t, "mine"), redistest.Queue(t, "theirs")
	s := newTestScheduler(t, Config{Queues: map[string]QueueConfig{mine: {}}})
	other := newTestScheduler(t, Config{Queues: map[string]QueueConfig{theirs: {}}})
	client := asynq.NewClient(asynq.RedisClientOpt{Addr: redistest.Addr(t)})
	defer client.Close()
	info, err := client.Enqueue(asynq.NewTask("test:orphan", nil), asynq.Queue(mine), asynq.MaxRetry(0), asynq.ProcessIn(time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	if err := s.inspector.ArchiveTask(mine, info.ID); err != nil {
		t.Fatal(err)
	}
	// As asynq's recoverer leaves a task whose worker died: its message's
	// last error (field 7 of asynq's TaskMessage; a field written again
	// replaces the first) is the expired lease.
	ctx := context.Background()
	rdb := redistest.Client(t)
	taskKey := asynqKeys(mine) + "t:" + info.ID
	msg, err := rdb.HGet(ctx, taskKey, "msg").Bytes()
	if err != nil {
		t.Fatal(err)
	}
	msg = protowire.AppendTag(msg, 7, protowire.BytesType)
	msg = protowire.AppendString(msg, asynq.ErrLeaseExpired.Error())
	if err := rdb.HSet(ctx, taskKey, "msg", msg).Err(); err != nil {
		t.Fatal(err)
	}
	if archived, err := s.inspector.GetTaskInfo(mine, info.ID); err != nil || archived.LastErr != asynq.ErrLeaseExpired.Error() {
		t.Fatalf("the orphan as asynq leaves one: %+v (%v)", archived, err)
	}
	other.rescuer.rescueOrphans(ctx) // the other fleet looks first
	s.rescuer.rescueOrphans(ctx)
	if st, err := s.inspector.GetTaskInfo(mine, info.ID); err != nil || st.State != asynq.TaskStatePending {
		t.Fatalf("after its fleet looked for orphans, just after another fleet did, the orphan is %v (%v), want pending", st.State, err)
	}
}

// TestCostAboveCapacity (9.7, 19.5): a task type whose cost a gate, or a
// key value's override of it, can never admit at once is refused at start
// and on reload, naming tasks.<type>.cost and the gate's key path. (A
// keyed drain's override was not checked: its tasks were archived, "can
// never be admitted".)
func TestCostAboveCapacity(t *testing.T) {
	keyed := func(l LimitConfig) *LimitConfig {
		l.Key, l.Overrides = "payload.tenant", map[string]LimitOverride{"small": {Limit: 1, Burst: 1}, "big": {Burst: 50}}
		return &l
	}
	for _, c := range []struct {
		desc  string
		drain *LimitConfig
		quota LimitConfig
		want  []string
	}{
		{desc: "the gates themselves", drain: &LimitConfig{Limit: 5, Period: time.Second, Burst: 2}, quota: LimitConfig{Limit: 10, Period: time.Second, Burst: 3},
			want: []string{"tasks.t.cost: 4 is more than quotas.api can ever admit at once (3)", "tasks.t.cost: 4 is more than queues.q.drain can ever admit at once (2)"}},
		{desc: "a keyed drain's override", drain: keyed(LimitConfig{Limit: 10, Period: time.Second, Burst: 10}), quota: LimitConfig{Limit: 10, Period: time.Second},
			want: []string{"tasks.t.cost: 4 is more than queues.q.drain.overrides.small can ever admit at once (1)"}},
		{desc: "a keyed quota's override", quota: *keyed(LimitConfig{Limit: 10, Period: time.Second}),
			want: []string{"tasks.t.cost: 4 is more than quotas.api.overrides.small can ever admit at once (1)"}},
	} {
		t.Run(c.desc, func(t *testing.T) {
			cfg := Config{
				Queues: map[string]QueueConfig{"q": {Drain: c.drain}},
				Quotas: map[string]LimitConfig{"api": c.quota},
				Tasks:  map[string]TaskConfig{"t": {Quotas: []string{"api"}, Cost: 4}},
			}
			var msgs []string
			for _, err := range cfg.Defaults().Validate() {
				msgs = append(msgs, err.Error())
			}
			if len(msgs) != len(c.want) {
				t.Errorf("%d problems, want %d:\n%s", len(msgs), len(c.want), strings.Join(msgs, "\n"))
			}
			all := strings.Join(msgs, "\n")
			for _, want := range c.want {
				if !strings.Contains(all, want) {
					t.Errorf("problems:\n%s\nwant one saying %q", all, want)
				}
			}
		})
	}
	cfg := Config{
		Queues: map[string]QueueConfig{"q": {Drain: &LimitConfig{Limit: 5, Period: time.Second, Burst: 2}}},
		Quotas: map[string]LimitConfig{"api": {Limit: 10, Period: time.Second, Burst: 3}},
		Tasks:  map[string]TaskConfig{"t": {Quotas: []string{"api"}, Cost: 4}},
	}
	s := newTestScheduler(t, Config{Queues: map[string]QueueConfig{"q": {}}})
	if err := s.Apply(cfg); err == nil || !strings.Contains(err.Error(), "tasks.t.cost") {
		t.Errorf("Apply of a cost above capacity: %v, want refused naming tasks.t.cost", err)
	}
}

// TestReloadQueuesRefused (10.2): a reload that adds or removes a queue is
// refused with an error saying a restart is needed, and the config in force
// stays, its drains included.
func TestReloadQueuesRefused(t *testing.T) {
	drain := &LimitConfig{Limit: 2, Period: time.Second, Burst: 1}
	cfg := Config{Queues: map[string]QueueConfig{"a": {Drain: drain}, "b": {}}}
	s := newTestScheduler(t, cfg)
	for _, queues := range []map[string]QueueConfig{{"b": {}}, {"a": {Drain: drain}, "b": {}, "c": {}}} {
		err := s.Apply(Config{Queues: queues})
		if !errors.Is(err, ErrRestartNeeded) || !strings.Contains(err.Error(), "restart") {
			t.Errorf("Apply changing the queues: %v, want ErrRestartNeeded", err)
		}
		if g := s.gates.Load().drains["a"]; g == nil {
			t.Fatal("queue a lost its drain after a refused reload")
		}
	}
}

// listen runs s's subscription to blocks until the test ends, and returns
// once it has first subscribed.
func listen(t *testing.T, s *Scheduler) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	t.Cleanup(func() {
		cancel()
		wg.Wait()
	})
	subscribed := make(chan struct{})
	var once sync.Once
	wg.Go(func() { s.board.listen(ctx, func() { once.Do(func() { close(subscribed) }) }) })
	select {
	case <-subscribed:
	case <-time.After(10 * time.Second):
		t.Fatal("not subscribed to blocks after 10s")
	}
}

// blocked reports whether s knows that quota is blocked now.
func blocked(s *Scheduler, quota string) bool {
	v, ok := s.board.blocked.Load(quota)
	return ok && v.(time.Time).After(time.Now())
}

// quotaConfig is a config with a token bucket quota of each name.
func quotaConfig(names ...string) Config {
	cfg := Config{Quotas: map[string]LimitConfig{}}
	for _, n := range names {
		cfg.Quotas[n] = LimitConfig{Limit: 10, Period: time.Second}
	}
	return cfg
}

// TestBlockAnnouncements (suspected by reading in issue 10): quota names
// with spaces and braces, on one server and on a cluster. A block
// announced on the channel ("<quota> <µs>") reaches a worker whatever the
// name; a block stored by Block (with no announcement) is read back by a
// worker when it subscribes. Names with braces never reach a key raw
// (throttle.Key escapes them): Block and Peek work on the cluster.
func TestBlockAnnouncements(t *testing.T) {
	ctx := context.Background()
	for name, rdb := range map[string]redis.UniversalClient{"redis": redistest.Client(t), "cluster": redistest.Cluster(t)} {
		t.Run(name, func(t *testing.T) {
			var quotas []string
			for _, q := range []string{"api", "my api", "{api}", "a}b {c"} {
				quotas = append(quotas, redistest.Queue(t, q))
			}
			cfg := quotaConfig(quotas...)
			early := newScheduler(t, rdb, cfg)
			listen(t, early)
			for _, q := range quotas {
				if err := rdb.Publish(ctx, blockChannel, q+" 60000000").Err(); err != nil {
					t.Fatal(err)
				}
				testkit.WaitFor(t, 5*time.Second, fmt.Sprintf("the block of quota %q announced", q), func() bool { return blocked(early, q) })
			}
			for _, q := range quotas {
				if err := early.gates.Load().quotas[q].lim.Block(ctx, q, time.Minute); err != nil {
					t.Fatalf("Block(%q): %v", q, err)
				}
			}
			late := newScheduler(t, rdb, cfg)
			listen(t, late)
			for _, q := range quotas {
				if !blocked(late, q) {
					t.Errorf("a worker that subscribed after quota %q was blocked does not know it", q)
				}
			}
		})
	}
}

// TestBlocksAfterSilentDeath (10.8): the connection of the subscription
// goes silent (its node's host died: no end of connection comes). The
// worker finds out by a ping within a few seconds, subscribes again, and
// receives the blocks announced from then on.
func TestBlocksAfterSilentDeath(t *testing.T) {
	t.Parallel() // it mostly waits: beside the package's other tests
	ctx := context.Background()
	rdb, proxy := redistest.ProxiedClient(t)
	quota := redistest.Queue(t, "api")
	s := newScheduler(t, rdb, quotaConfig(quota))
	listen(t, s)
	proxy.Silence()
	silenced := time.Now()
	publisher := redistest.Client(t)
	testkit.WaitFor(t, 5*time.Second, "a block announced after the silence", func() bool {
		if err := publisher.Publish(ctx, blockChannel, quota+" 60000000").Err(); err != nil {
			t.Fatal(err)
		}
		return blocked(s, quota)
	})
	t.Logf("a block announced after the subscription went silent arrived %v after", time.Since(silenced).Round(10*time.Millisecond))
}

// TestBlocksAfterFailover (10.8): on a cluster of 3 masters with a replica
// each, the node that holds the worker's subscription is killed, and its
// replica takes over. Blocks announced after the failover reach the worker
// within a few seconds, and none is lost after the first; a block stored
// while the worker had no subscription (its announcement was lost) is read
// back once it has subscribed again.
func TestBlocksAfterFailover(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cluster := redistest.StartCluster(t)
	rdb := cluster.Client(t)
	// Its key's slot, 6541, and the blocks channel's, 13005, are on
	// different masters of the three: the master killed is not the quota's.
	quota := "api"
	var announced []string
	for i := range 200 {
		announced = append(announced, "m"+strconv.Itoa(i))
	}
	s := newScheduler(t, rdb, quotaConfig(append(announced, quota)...))
	listen(t, s)
	node := subscriberNode(t, cluster)
	cluster.Node(node).Kill()
	killed := time.Now()
	if err := s.gates.Load().quotas[quota].lim.Block(ctx, quota, time.Minute); err != nil {
		t.Fatalf("Block: %v", err)
	}
	cluster.WaitHealthy(t)
	failedOver := time.Now()
	// Announce a block every 20ms for 2s.
	publisher := cluster.Client(t)
	published := map[string]time.Time{}
	for _, m := range announced {
		if time.Since(failedOver) > 2*time.Second {
			break
		}
		if publisher.Publish(ctx, blockChannel, m+" 60000000").Err() == nil {
			published[m] = time.Now()
		}
		time.Sleep(20 * time.Millisecond)
	}
	time.Sleep(200 * time.Millisecond)
	var first time.Time // when the first announcement received was published
	received := 0
	for _, m := range announced {
		at, ok := published[m]
		if !ok {
			continue
		}
		if blocked(s, m) {
			received++
			if first.IsZero() {
				first = at
			}
		} else if !first.IsZero() {
			t.Errorf("announcement %s, published %v after the failover, after another was received, was lost", m, at.Sub(failedOver).Round(time.Millisecond))
		}
	}
	if first.IsZero() || first.Sub(failedOver) > time.Second {
		t.Fatalf("failed over in %v; no announcement published within 1s after was received (%d of %d published received)",
			failedOver.Sub(killed).Round(10*time.Millisecond), received, len(published))
	}
	t.Logf("killed the subscription's node: failed over in %v; the first announcement received was published %v after the failover; %d of %d published received",
		failedOver.Sub(killed).Round(10*time.Millisecond), first.Sub(failedOver).Round(10*time.Millisecond), received, len(published))
	if !blocked(s, quota) {
		t.Fatal("the block stored while the worker had no subscription is not known after it subscribed again")
	}
}

// subscriberNode is the address of the node that holds the one
// subscription to blockChannel.
func subscriberNode(t *testing.T, c *redistest.FailoverCluster) string {
	t.Helper()
	ctx := context.Background()
	for _, addr := range c.Addrs() {
		rdb := redis.NewClient(&redis.Options{Addr: addr})
		clients, err := rdb.ClientList(ctx).Result()
		rdb.Close()
		if err != nil {
			t.Fatal(err)
		}
		for _, line := range strings.Split(clients, "\n") {
			// Subscribed to channels (blocks and the runtime limits').
			if strings.Contains(line, " sub=") && !strings.Contains(line, " sub=0 ") {
				return addr
			}
		}
	}
	t.Fatal("no node holds the subscription to blocks")
	return ""
}
