package test

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/internal/redistest"
	"github.com/sluicehq/sluice/internal/testkit"
)

// waitingDoc is what TestEnqueueStatusWaiting reads of status --json.
type waitingDoc struct {
	Queues []struct {
		Name                               string
		Pending, Waiting, Scheduled, Retry int
	}
	Quotas []struct {
		Name  string
		Level *int
	}
	Workers []workerDoc
}

type workerDoc struct {
	PID          int
	Concurrency  int
	WaitingSlots int `json:"waiting_slots"`
}

// TestEnqueueStatusWaiting: during a drain of 60 tasks at 5/s (worker
// concurrency 10, tasks waiting in Redis for their turn), status counts
// them as WAITING, not RETRY (none failed); once the worker has stopped,
// its count is exactly what Redis holds: the tasks of the retry set whose
// last error is sluice's wait. The worker shows concurrency 10 (+10
// waiting), as configured, and a keyed quota no level of its own.
func TestEnqueueStatusWaiting(t *testing.T) {
	t.Parallel()
	addr := redistest.Addr(t)
	queue, keyed := redistest.Queue(t, "status"), redistest.Queue(t, "keyed")
	config := writeConfig(t, fmt.Sprintf(`
redis: {addr: %s}
worker: {concurrency: 10, hold_max: 100ms}
queues:
  %s: {drain: {algorithm: leaky_bucket, limit: 5, period: 1s, burst: 1}}
quotas:
  %s: {limit: 5, period: 1s, key: payload.token}
`, addr, queue, keyed))
	w := startWorker(t, config)
	if r := runEnqueue(t, addr, nil, "--config", config, "--queue", queue, "--count", "60", "demo:noop"); r.code != 0 {
		t.Fatalf("enqueue:\n%v", r)
	}
	status := func() waitingDoc {
		t.Helper()
		r := runEnqueue(t, addr, nil, "--config", config, "status", "--json")
		var doc waitingDoc
		if err := json.Unmarshal([]byte(r.stdout), &doc); r.code != 0 || err != nil {
			t.Fatalf("status --json: %v\n%v", err, r)
		}
		return doc
	}
	var during waitingDoc
	testkit.WaitFor(t, 10*time.Second, "tasks waiting for their turn", func() bool {
		during = status()
		return during.Queues[0].Waiting >= 10
	})
	q := during.Queues[0]
	t.Logf("during the drain: %+v", q)
	if q.Name != queue || q.Retry != 0 {
		t.Errorf("status during the drain: %+v; want queue %s, 0 retries (no task failed)", q, queue)
	}
	i := slices.IndexFunc(during.Workers, func(wk workerDoc) bool { return wk.PID == w.cmd.Process.Pid })
	if i < 0 || during.Workers[i].Concurrency != 10 || during.Workers[i].WaitingSlots != 10 {
		t.Errorf("workers %+v; want pid %d of concurrency 10 (+10 waiting slots)", during.Workers, w.cmd.Process.Pid)
	}
	if len(during.Quotas) != 1 || during.Quotas[0].Level != nil {
		t.Errorf("quotas %+v; want %s with no level (keyed)", during.Quotas, keyed)
	}
	r := runEnqueue(t, addr, nil, "--config", config, "status")
	if want := "per key: status --keys quota:" + keyed; !strings.Contains(r.stdout, want) || !strings.Contains(r.stdout, "10 (+10 waiting)") {
		t.Errorf("status: want %q and the worker's 10 (+10 waiting)\n%v", want, r)
	}
	t.Logf("status:\n%s", r.stdout)

	// Stopped, the worker moves no task: status and Redis must agree.
	w.cmd.Process.Signal(syscall.SIGTERM)
	testkit.WaitFor(t, 15*time.Second, "the worker to stop", func() bool {
		resp, err := http.Get("http://" + w.metrics + "/healthz")
		if err == nil {
			resp.Body.Close()
		}
		return err != nil
	})
	inspector := asynq.NewInspector(asynq.RedisClientOpt{Addr: addr})
	defer inspector.Close()
	retries, err := inspector.ListRetryTasks(queue, asynq.PageSize(1000))
	if err != nil {
		t.Fatal(err)
	}
	waiting := 0
	for _, info := range retries {
		if strings.Contains(info.LastErr, "for its turn (not a failure)") {
			waiting++
		}
	}
	after := status().Queues[0]
	if after.Waiting != waiting || after.Retry != len(retries)-waiting || waiting == 0 {
		t.Errorf("status after the stop: %+v; Redis holds %d tasks in the retry set, %d of them waiting for their turn", after, len(retries), waiting)
	}
	t.Logf("after the stop: %+v; Redis: %d in the retry set, %d waiting", after, len(retries), waiting)
}

// TestHashedKeysHidden: a quota keyed by an API token with hash_keys: after
// a drain of 12 tasks of one token and 8 of another (one with an override,
// given by its token), no Redis key name, no status output and no line of
// the worker's log holds either token; status --keys --key TOKEN finds the
// token's key by its hash, throttled.
func TestHashedKeysHidden(t *testing.T) {
	t.Parallel()
	addr := redistest.Addr(t)
	queue, quota := redistest.Queue(t, "tokens"), redistest.Queue(t, "per-token")
	const small, big = "tok-secret-small-1f9c", "tok-secret-big-77ab"
	u := newUpstream(t)
	config := writeConfig(t, fmt.Sprintf(`
redis: {addr: %s}
worker: {concurrency: 10}
queues:
  %s: {}
quotas:
  %s: {limit: 4, period: 1s, burst: 4, key: 'payload.headers["X-Token"]', hash_keys: true, overrides: {%s: {limit: 40, burst: 40}}}
tasks:
  http:request: {quotas: [%s]}
%s`, addr, queue, quota, big, quota, u.allowYAML()))
	w := startWorker(t, config)
	client := asynq.NewClient(asynq.RedisClientOpt{Addr: addr})
	defer client.Close()
	enqueueWithHeaders(t, client, u.URL, queue, "small", 12, map[string]string{"X-Token": small})
	enqueueWithHeaders(t, client, u.URL, queue, "big", 8, map[string]string{"X-Token": big})

	var outputs []string
	status := func(args ...string) string {
		t.Helper()
		r := runEnqueue(t, addr, nil, append([]string{"--config", config, "status"}, args...)...)
		if r.code != 0 {
			t.Fatalf("status %q:\n%v", args, r)
		}
		outputs = append(outputs, r.stdout)
		return r.stdout
	}
	sum := sha256.Sum256([]byte(small))
	hashed := "sha256:" + hex.EncodeToString(sum[:16])
	var found keysDoc
	testkit.WaitFor(t, 10*time.Second, "status --keys --key to find the small token throttled", func() bool {
		found = keysDoc{}
		err := json.Unmarshal([]byte(status("--keys", quota, "--key", small, "--json")), &found)
		return err == nil && len(found.Keys) == 1 && found.Keys[0].Throttled > 0
	})
	if found.Keys[0].Key != hashed {
		t.Errorf("status --keys --key %s: key %q, want its hash %s", small, found.Keys[0].Key, hashed)
	}
	t.Logf("status --keys %s --key %s:\n%s", quota, small, status("--keys", quota, "--key", small))
	status("--keys", quota)
	status("--keys", quota, "--json")
	status()
	testkit.WaitFor(t, 15*time.Second, "every request", func() bool { return len(u.All()) == 20 })

	rdb := redis.NewClient(&redis.Options{Addr: addr})
	defer rdb.Close()
	for _, token := range []string{small, big} {
		keys, err := rdb.Keys(context.Background(), "*"+token+"*").Result()
		if err != nil || len(keys) > 0 {
			t.Errorf("Redis key names holding %s: %q (%v), want none", token, keys, err)
		}
		for _, out := range outputs {
			if strings.Contains(out, token) {
				t.Errorf("status output holds %s:\n%s", token, out)
			}
		}
		if log, _ := os.ReadFile(w.log); strings.Contains(string(log), token) {
			t.Errorf("the worker's log holds %s:\n%s", token, log)
		}
	}
}
