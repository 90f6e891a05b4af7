// A fleet on a backend: the Redis it runs on (standalone, the cluster, or a
// cluster of the test's own), its workers, its tasks and its costs.

package test

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/sluicehq/sluice/internal/redistest"
	"github.com/sluicehq/sluice/internal/testkit"
)

// backend is a Redis the fleet runs on: the standalone server or the
// 3-master cluster that `make test` starts, or a cluster of the test's own.
type backend struct {
	name    string
	cluster bool
	nodes   []string // the cluster's nodes, if not the one of make test
	login   string   // the workers' redis.username and redis.password, as YAML keys, if not the default user
}

var backends = []backend{{name: "standalone"}, {name: "cluster", cluster: true}}

// yaml is the redis section of a config for the backend.
func (b backend) yaml(t *testing.T) string {
	if b.cluster {
		return fmt.Sprintf("redis: {cluster: [%s]%s}", strings.Join(b.clusterNodes(t), ", "), b.login)
	}
	return fmt.Sprintf("redis: {addr: %s%s}", redistest.Addr(t), b.login)
}

func (b backend) clusterNodes(t *testing.T) []string {
	if b.nodes != nil {
		return b.nodes
	}
	return redistest.ClusterAddrs(t)
}

// asynqOpt connects the test to the backend, as the default user.
func (b backend) asynqOpt(t *testing.T) asynq.RedisConnOpt {
	if b.cluster {
		return asynq.RedisClusterClientOpt{Addrs: b.clusterNodes(t)}
	}
	return asynq.RedisClientOpt{Addr: redistest.Addr(t)}
}

// checkQueueEmpty fails the test if anything of queue is left in Redis:
// archived, retried, failed, pending, scheduled or active.
func (b backend) checkQueueEmpty(t *testing.T, queue string) {
	t.Helper()
	inspector := asynq.NewInspector(b.asynqOpt(t))
	defer inspector.Close()
	info, err := inspector.GetQueueInfo(queue)
	if err != nil {
		t.Fatalf("asynq queue %q: %v", queue, err)
	}
	if info.Archived != 0 || info.Retry != 0 || info.Failed != 0 || info.Pending != 0 || info.Scheduled != 0 || info.Active != 0 {
		t.Errorf("queue %s after the run: archived %d, retry %d, failed today %d, pending %d, scheduled %d, active %d; want all 0",
			queue, info.Archived, info.Retry, info.Failed, info.Pending, info.Scheduled, info.Active)
	}
}

// fleetRun is a fleet of workers on one config, its upstream, and what it
// costs in limiter calls.
type fleetRun struct {
	backend
	u      *upstream
	fleet  []*worker
	config string // the workers' config file
}

func startFleet(t *testing.T, b backend, workers int, config string) *fleetRun {
	t.Helper()
	r := &fleetRun{backend: b, u: newUpstream(t)}
	path := writeConfig(t, b.yaml(t)+"\n"+config+r.u.allowYAML())
	r.config = path
	for range workers {
		r.fleet = append(r.fleet, startWorker(t, path))
	}
	return r
}

// enqueue puts n http:request tasks for the run's upstream into queue,
// their paths under prefix, every other one with MaxRetry 0.
func (r *fleetRun) enqueue(t *testing.T, queue, prefix string, n int) {
	t.Helper()
	enqueueRequestsOn(t, r.asynqOpt(t), r.u, queue, prefix, n)
}

// enqueueBacklogs puts counts[i] tasks into queues[i] (as enqueue) while
// the queues are paused, then lets the fleet at all of them at once: each
// drain starts on a full backlog. (Tasks enqueued one by one into running
// queues reach their drains at the producer's pace, on a loaded machine
// slower than the drain for a while: a rate measured from the first
// request would count the producer.)
func (r *fleetRun) enqueueBacklogs(t *testing.T, queues []string, counts []int) {
	t.Helper()
	r.pause(t, queues...)
	for i, q := range queues {
		r.enqueue(t, q, q, counts[i])
	}
	r.letGo(t, queues...)
}

// pause pauses queues: the fleet takes none of their tasks until letGo.
func (r *fleetRun) pause(t *testing.T, queues ...string) {
	t.Helper()
	inspector := asynq.NewInspector(r.asynqOpt(t))
	defer inspector.Close()
	for _, q := range queues {
		if err := inspector.PauseQueue(q); err != nil {
			t.Fatalf("pausing %s: %v", q, err)
		}
	}
}

// letGo unpauses queues and returns when it began.
func (r *fleetRun) letGo(t *testing.T, queues ...string) time.Time {
	t.Helper()
	inspector := asynq.NewInspector(r.asynqOpt(t))
	defer inspector.Close()
	start := time.Now()
	for _, q := range queues {
		if err := inspector.UnpauseQueue(q); err != nil {
			t.Fatalf("unpausing %s: %v", q, err)
		}
	}
	return start
}

// counter sums a counter over the fleet.
func (r *fleetRun) counter(t *testing.T, name string, match ...string) float64 {
	t.Helper()
	sum := 0.0
	for _, w := range r.fleet {
		sum += w.counter(t, name, match...)
	}
	return sum
}

// costs reports what the run cost per task: limiter calls (bookings, one
// per task and slot) and gate evaluations, trips back to Redis.
func (r *fleetRun) costs(t *testing.T, tasks int) string {
	t.Helper()
	n := float64(tasks)
	return fmt.Sprintf("per task: %.2f bookings, %.2f gate evaluations, %.2f requeues, %.2f held in a worker",
		r.counter(t, "sluice_bookings_total")/n, r.counter(t, "sluice_gate_evaluations_total")/n,
		r.counter(t, "sluice_throttled_tasks_total", `how="requeued"`)/n, r.counter(t, "sluice_throttled_tasks_total", `how="held"`)/n)
}

// finish waits for n requests, lets duplicates show, and checks that each
// of n distinct tasks ran once and that nothing is left in queues.
func (r *fleetRun) finish(t *testing.T, n int, d time.Duration, queues ...string) []time.Time {
	t.Helper()
	testkit.WaitFor(t, d, fmt.Sprintf("%d requests", n), func() bool { return len(r.u.All()) >= n })
	time.Sleep(300 * time.Millisecond)
	arrivals := r.u.All()
	if len(arrivals) != n || r.u.Distinct() != n {
		t.Errorf("%d requests for %d distinct tasks, want %d of %d: tasks lost or run twice", len(arrivals), r.u.Distinct(), n, n)
	}
	if failed := r.counter(t, "sluice_tasks_processed_total", `result="error"`); failed > 0 {
		t.Errorf("%v handler runs failed, want 0", failed)
	}
	for _, q := range queues {
		r.checkQueueEmpty(t, q)
	}
	return arrivals
}
