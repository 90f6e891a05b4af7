package test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/internal/redistest"
	"github.com/sluicehq/sluice/internal/testkit"
	"github.com/sluicehq/sluice/throttle"
)

// TestClusterFailover: three workers on a Redis Cluster of the test's own
// (3 masters, one replica each), logged in as the ACL user of
// docs/security.md, drain a queue at 20/s (leaky bucket, burst 1) whose
// tasks also draw on a quota far above it. The master that holds the queue (asynq's keys of it and
// its drain's state: one hash tag, one slot) is killed with -9 mid-run.
// Once its replica is promoted, the fleet goes on with no worker
// restarted: every worker runs tasks again, the drain is at 20/s within
// 2% from 2 s after the promotion, and 480 tasks (half with MaxRetry 0)
// each ran once, none failed, archived or left behind (a task that ended
// during the outage waits for Redis to take its end: see the worker's
// settler); no node's ACL LOG holds a refusal.
func TestClusterFailover(t *testing.T) {
	t.Parallel()
	const tasks, perSecond = 480, 20
	c := redistest.StartCluster(t)
	const password = "failover"
	acl := documentedACL(t, password)
	for _, n := range c.Nodes { // ACL users are each node's own
		rdb := redis.NewClient(&redis.Options{Addr: n.Addr})
		err := rdb.Do(context.Background(), acl...).Err()
		rdb.Close()
		if err != nil {
			t.Fatalf("the documented ACL on %s: %v", n.Addr, err)
		}
	}
	b := backend{name: "failover", cluster: true, nodes: c.Addrs(), login: ", username: sluice, password: " + password}
	queue, quota := redistest.Queue(t, "q"), redistest.Queue(t, "api")
	r := startFleet(t, b, 3, fmt.Sprintf(`
worker: {concurrency: 10}
queues:
  %s: {drain: {algorithm: leaky_bucket, limit: %d, period: 1s, burst: 1}}
quotas:
  %s: {algorithm: token_bucket, limit: 400, period: 1s, burst: 40}
tasks:
  http:request: {quotas: [%s]}
`, queue, perSecond, quota, quota))

	pending := "asynq:{" + queue + "}:pending"
	admin := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs()})
	defer admin.Close()
	ctx := context.Background()
	if a, d := admin.ClusterKeySlot(ctx, pending).Val(), admin.ClusterKeySlot(ctx, throttle.Key("sluice:drain:", queue)).Val(); a != d {
		t.Fatalf("the queue's asynq keys are in slot %d, its drain's in slot %d: killing one master would not take both", a, d)
	}
	master := c.MasterOf(t, pending)

	r.enqueue(t, queue, "r", tasks)
	u := r.u
	testkit.WaitFor(t, 20*time.Second, "the run to get going", func() bool { return len(u.All()) >= 4*perSecond })
	master.Kill()
	killed := time.Now()
	promoted := c.WaitPromoted(t, pending, master)
	ran := make([]float64, len(r.fleet))
	for i, w := range r.fleet {
		ran[i] = w.counter(t, "sluice_tasks_processed_total")
	}
	arrivals := r.finish(t, tasks, 60*time.Second, queue)

	// The tasks whose turns fell in the outage book again, behind the
	// backlog: the drain is held to its rate before them, from 2 s to 12 s
	// after the promotion; the rate to the end, with them, is logged.
	end := arrivals[len(arrivals)-1].Add(time.Nanosecond)
	before, after := between(arrivals, arrivals[0], killed), between(arrivals, promoted, end)
	steady := between(arrivals, promoted.Add(2*time.Second), promoted.Add(12*time.Second))
	t.Logf("master %s killed after %d requests (%.3f/s); its replica promoted %v later; from the promotion on: %.3f/s, %.3f/s from 2 s to 12 s after it (%d requests), "+
		"at most %d in a second, at most %.2f over 1 + %d·T; %s",
		master.Addr, len(before), rate(before), promoted.Sub(killed).Round(time.Millisecond), rate(after), rate(steady), len(steady),
		testkit.MaxInWindow(after, time.Second-within), overAllowance(after, 1, perSecond), perSecond, r.costs(t, tasks))
	if end.Before(promoted.Add(12 * time.Second)) {
		t.Fatalf("the run ended %v after the promotion, too soon to measure the drain up to 12 s after it", end.Sub(promoted))
	}
	if got := rate(steady); got < 0.98*perSecond || got > 1.02*perSecond {
		t.Errorf("drained at %.3f/s from 2 s to 12 s after the promotion, want %d/s within 2%%", got, perSecond)
	}
	for i, w := range r.fleet {
		if n := w.counter(t, "sluice_tasks_processed_total") - ran[i]; n == 0 {
			t.Errorf("worker %s ran no task after the promotion", w.metrics)
		}
	}
	for _, addr := range c.Addrs() {
		if addr == master.Addr {
			continue
		}
		rdb := redis.NewClient(&redis.Options{Addr: addr})
		checkACLLog(t, rdb)
		rdb.Close()
	}
}
