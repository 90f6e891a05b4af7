package jobs_test

import (
	"context"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/internal/redistest"
	"github.com/sluicehq/sluice/internal/testkit"
	"github.com/sluicehq/sluice/jobs"
)

// TestRedisUnreachable: the queues are on a real redis-server, but the
// Redis that holds the limits cannot be reached (a closed port). Each gate
// does what its on_redis_error says, and counts it.
func TestRedisUnreachable(t *testing.T) {
	t.Parallel() // it waits on fleets and turns, beside the package's other tests
	cases := []struct {
		desc   string
		policy string
		check  func(t *testing.T, runs []time.Time)
	}{
		{"deny holds every task", jobs.OnRedisErrorDeny, func(t *testing.T, runs []time.Time) {
			if len(runs) != 0 {
				t.Fatalf("%d tasks ran through a gate whose policy is deny", len(runs))
			}
		}},
		{"allow lets every task through", jobs.OnRedisErrorAllow, func(t *testing.T, runs []time.Time) {
			if len(runs) != 20 {
				t.Fatalf("%d of 20 tasks ran through a gate whose policy is allow", len(runs))
			}
		}},
		{"local limits in process", jobs.OnRedisErrorLocal, func(t *testing.T, runs []time.Time) {
			// 5/s with burst 1 for this worker (or less, if the fleet it sees
			// is larger): at most 1 + 5·T tasks in T from the first to the
			// last (tasks that hold a turn still run while the server stops).
			if len(runs) == 0 {
				t.Fatal("no task ran through a local twin of 5/s")
			}
			if span := runs[len(runs)-1].Sub(runs[0]); float64(len(runs)) > 1+5*(span+10*time.Millisecond).Seconds() {
				t.Fatalf("%d tasks in %v through a local twin of 5/s", len(runs), span)
			}
			if most := testkit.MaxInWindow(runs, time.Second); most > 6 {
				t.Fatalf("%d tasks within one second through a local twin of 5/s", most)
			}
		}},
	}
	for _, c := range cases {
		t.Run(c.desc, func(t *testing.T) {
			queue := redistest.Queue(t, "q")
			cfg := jobs.Config{
				Worker: jobs.WorkerConfig{Concurrency: 10},
				Queues: map[string]jobs.QueueConfig{queue: {Drain: &jobs.LimitConfig{Limit: 5, Period: time.Second, Burst: 1, OnRedisError: c.policy}}},
			}
			dead := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", MaxRetries: -1, DialTimeout: 100 * time.Millisecond})
			t.Cleanup(func() { dead.Close() })
			opt := asynq.RedisClientOpt{Addr: redistest.Addr(t)}
			reg := prometheus.NewRegistry()
			sched, err := jobs.NewScheduler(dead, opt, cfg, jobs.NewMetrics(reg), slog.New(slog.NewTextHandler(io.Discard, nil)))
			if err != nil {
				t.Fatal(err)
			}
			// Run counts the fleet: the local policy waits for its count.
			ctx, stop := context.WithCancel(context.Background())
			go sched.Run(ctx)
			rec := &recorder{}
			mux := asynq.NewServeMux()
			mux.Use(sched.Middleware)
			mux.Handle("test:record", rec)
			srvCfg := sched.AsynqConfig()
			srvCfg.ShutdownTimeout = time.Second // deny holds its tasks until then
			srv := asynq.NewServer(opt, srvCfg)
			if err := srv.Start(mux); err != nil {
				t.Fatal(err)
			}
			enqueue(t, queue, 20)
			time.Sleep(5 * time.Second)
			srv.Shutdown()
			stop()
			sched.Close()

			c.check(t, rec.All())
			if n := counterSum(t, reg, "sluice_policy_fallbacks_total"); n == 0 {
				t.Fatal("no fallback counted in sluice_policy_fallbacks_total")
			}
			if n := counterSum(t, reg, "sluice_redis_errors_total"); n == 0 {
				t.Fatal("no Redis error counted in sluice_redis_errors_total")
			}
			// Tasks held by deny are still in the queue, not lost.
			info := redistest.QueueInfo(t, queue)
			if left := info.Pending + info.Active + info.Scheduled + info.Retry; left+len(rec.All()) != 20 || info.Archived != 0 {
				t.Fatalf("%d ran, %d left, %d archived: want the 20 tasks run or still queued", len(rec.All()), left, info.Archived)
			}
		})
	}
}

// TestLocalPolicyFleetStart (issue 19.13): three workers started together
// whose Redis user may not touch a quota's keys (an ACL; the queues and
// sluice's other keys work), a quota of 6/s, burst 1, on the local policy;
// the workers hold tasks for their turns (hold_max 10s), so each twin's
// rate shows. Each twin is the quota divided by the fleet, 2/s with a
// burst of 1, from the first task on: at most 3 + 6 tasks run in any
// second, and all 60 run within 40 s (a worker that holds most of them
// runs them at its share, 2/s: 30 s). On main each worker counted the
// fleet before the others had registered, and again only 10 s later:
// 18 or 19 ran in a second. The Redis is shared with servers of another
// fleet, on another queue, as a company's Redis often is: they do not
// draw on this fleet's quota, so they do not shrink its twins (each
// worker counted every asynq server on the Redis: with 6 others, each
// twin made 0.67/s, and in the package's runs, beside other tests'
// workers, 60 tasks took 67 s).
func TestLocalPolicyFleetStart(t *testing.T) {
	t.Parallel() // it waits on fleets and turns, beside the package's other tests
	const perSecond, workers, tasks = 6, 3, 60
	queue := redistest.Queue(t, "q")
	quota := redistest.Queue(t, "api")
	cfg := jobs.Config{
		Worker: jobs.WorkerConfig{Concurrency: 10, Waiting: 40, HoldMax: 10 * time.Second},
		Queues: map[string]jobs.QueueConfig{queue: {}},
		Quotas: map[string]jobs.LimitConfig{quota: {Limit: perSecond, Period: time.Second, Burst: 1, OnRedisError: jobs.OnRedisErrorLocal}},
		Tasks:  map[string]jobs.TaskConfig{"test:record": {Quotas: []string{quota}}},
	}
	user, password := redistest.ACLUser(t, "asynq:*", "sluice:drain:*", "sluice:concurrency:*", "sluice:wake:*", "sluice:waker:*",
		"sluice:rate:*", "sluice:rescue:*", "sluice:rescued:*", "sluice:rebook:*", "sluice:fair:*",
		"sluice:park:*", "sluice:backlog:*", "sluice:{limits}:*")
	rdb := redis.NewClient(&redis.Options{Addr: redistest.Addr(t), Username: user, Password: password})
	t.Cleanup(func() { rdb.Close() })
	for range 6 {
		other := asynq.NewServer(asynq.RedisClientOpt{Addr: redistest.Addr(t)},
			asynq.Config{Queues: map[string]int{redistest.Queue(t, "other-fleet"): 1}, LogLevel: asynq.WarnLevel})
		if err := other.Start(asynq.NewServeMux()); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(other.Shutdown)
	}
	rec := &recorder{}
	metrics := jobs.NewMetrics(prometheus.NewRegistry())
	for range workers {
		startWorker(t, rdb, cfg, metrics, rec)
	}
	enqueue(t, queue, tasks)
	testkit.WaitFor(t, 90*time.Second, "every task to run", func() bool { return len(rec.All()) == tasks })
	runs := rec.All()
	// At one twin's share, 2/s, the most a worker holding nearly all the
	// tasks can run: 30 s, and 2 s before the fleet is counted.
	if took, most := runs[len(runs)-1].Sub(runs[0]), time.Duration(tasks)*time.Second*workers/perSecond+10*time.Second; took > most {
		t.Errorf("%d tasks took %v, want at most %v: the twins were smaller than the quota divided by this fleet's %d workers", tasks, took.Round(time.Millisecond), most, workers)
	}
	var perSec []int
	for _, r := range runs {
		i := int(r.Sub(runs[0]) / time.Second)
		for len(perSec) <= i {
			perSec = append(perSec, 0)
		}
		perSec[i]++
	}
	t.Logf("%d tasks in %v, by second %v", len(runs), runs[len(runs)-1].Sub(runs[0]).Round(time.Millisecond), perSec)
	if most := testkit.MaxInWindow(runs, time.Second); most > workers+perSecond {
		t.Fatalf("%d tasks ran within one second through local twins of a %d/s quota on %d workers, want at most %d", most, perSecond, workers, workers+perSecond)
	}
}

// TestDenyWaitsInRedis (9.5): with the limits' Redis down and a gate whose
// policy is deny, its tasks wait in Redis, not in the worker's slots: an
// ungated queue on the same worker (concurrency 2) runs all its tasks at
// once, and the gated tasks (Timeout 3s, MaxRetry 0) are never archived.
func TestDenyWaitsInRedis(t *testing.T) {
	t.Parallel()
	gated, free := redistest.Queue(t, "gated"), redistest.Queue(t, "free")
	cfg := jobs.Config{
		Worker: jobs.WorkerConfig{Concurrency: 2},
		Queues: map[string]jobs.QueueConfig{
			gated: {Drain: &jobs.LimitConfig{Limit: 5, Period: time.Second, Burst: 1, OnRedisError: jobs.OnRedisErrorDeny}},
			free:  {},
		},
	}
	dead := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", MaxRetries: -1, DialTimeout: 100 * time.Millisecond})
	t.Cleanup(func() { dead.Close() })
	opt := asynq.RedisClientOpt{Addr: redistest.Addr(t)}
	sched, err := jobs.NewScheduler(dead, opt, cfg, jobs.NewMetrics(prometheus.NewRegistry()), slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	rec := &recorder{}
	mux := asynq.NewServeMux()
	mux.Use(sched.Middleware)
	mux.Handle("test:record", rec)
	srvCfg := sched.AsynqConfig()
	srvCfg.ShutdownTimeout = time.Second
	srv := asynq.NewServer(opt, srvCfg)
	if err := srv.Start(mux); err != nil {
		t.Fatal(err)
	}
	defer func() { srv.Shutdown(); sched.Close() }()
	enqueue(t, gated, 6, asynq.Timeout(3*time.Second), asynq.MaxRetry(0))
	time.Sleep(200 * time.Millisecond) // the gated ones first
	enqueue(t, free, 10)
	testkit.WaitFor(t, 3*time.Second, "the ungated queue's tasks", func() bool { return len(rec.All()) >= 10 })
	time.Sleep(4 * time.Second) // past the gated tasks' timeout
	if info := redistest.QueueInfo(t, gated); info.Archived != 0 || info.Failed != 0 {
		t.Fatalf("gated queue while its limits' Redis is down: %d archived, %d failed; want none: they wait in Redis", info.Archived, info.Failed)
	}
	if ran := len(rec.All()); ran != 10 {
		t.Fatalf("%d tasks ran, want the 10 ungated ones only", ran)
	}
}
