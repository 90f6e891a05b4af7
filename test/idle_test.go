package test

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/internal/redistest"
	"github.com/sluicehq/sluice/internal/testkit"
)

// TestIdleFleetCost (issue 20, backlogs that cost nothing while they
// wait): a fleet with nothing to do costs Redis little. 3 workers on a
// redis-server of the test's own (its command counts are theirs alone),
// 3 queues (a drain, a fair queue, none), no task: asynq's processors poll
// every queue about 10 times a second and its forwarders look at the
// scheduled and retry sets every second, and each queue's waker looks at
// its wake set 10 times a second; an empty poll or look is a plain
// command, not a script run (before: 160 script runs and 610 commands a
// second; now about 1 and 200).
func TestIdleFleetCost(t *testing.T) {
	t.Parallel()
	srv := redistest.StartServer(t)
	config := writeConfig(t, fmt.Sprintf(`
redis: {addr: %s}
worker: {concurrency: 2}
queues:
  plain: {}
  drained: {drain: {limit: 20, period: 1s}}
  fair: {drain: {limit: 20, period: 1s, burst: 1}, fairness: {key: 'payload.customer'}}
tasks:
  demo:noop: {}
`, srv.Addr))
	for range 3 {
		startWorker(t, config)
	}
	ctx := context.Background()
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer rdb.Close()
	// Each worker's startup (scripts loaded, the fleet registered, the
	// first looks) is not what idling costs.
	testkit.WaitFor(t, 10*time.Second, "3 workers to serve", func() bool {
		n, _ := rdb.Keys(ctx, "asynq:servers:*").Result()
		return len(n) == 3
	})
	time.Sleep(time.Second)
	const span = 4 * time.Second
	before, start := commandStats(t, rdb), time.Now()
	time.Sleep(span)
	after, took := commandStats(t, rdb), time.Since(start).Seconds()

	scripts, commands := 0.0, 0.0
	var rows []string
	for name, calls := range after {
		d := float64(calls - before[name])
		commands += d
		if name == "evalsha" || name == "eval" || name == "fcall" || name == "fcall_ro" || name == "evalsha_ro" {
			scripts += d
		}
		if d > 0 {
			rows = append(rows, fmt.Sprintf("%s %.1f/s", name, d/took))
		}
	}
	t.Logf("3 idle workers, 3 queues: %.1f script runs and %.0f commands a second (%s)", scripts/took, commands/took, strings.Join(rows, ", "))
	// What is left: asynq's heartbeats, its janitor and recoverer, sluice's
	// fleet housekeeping and the wakers' lease renewals, a few a second.
	if most := 8.0; scripts/took > most {
		t.Errorf("3 idle workers ran %.1f scripts a second, want at most %.0f: empty polls and looks must not run scripts", scripts/took, most)
	}
	// The bulk: asynq's polls, one LLEN per queue and worker 10 times a
	// second (600 commands a second before, 200 now).
	if most := 300.0; commands/took > most {
		t.Errorf("3 idle workers sent %.0f commands a second, want at most %.0f", commands/took, most)
	}
}

// commandStats is INFO commandstats: calls by command name.
func commandStats(t *testing.T, rdb *redis.Client) map[string]int64 {
	t.Helper()
	info, err := rdb.Info(context.Background(), "commandstats").Result()
	if err != nil {
		t.Fatal(err)
	}
	calls := map[string]int64{}
	for _, line := range strings.Split(info, "\n") {
		name, rest, ok := strings.Cut(strings.TrimSpace(line), ":calls=")
		if !ok {
			continue
		}
		n, _, _ := strings.Cut(rest, ",")
		calls[strings.TrimPrefix(name, "cmdstat_")], _ = strconv.ParseInt(n, 10, 64)
	}
	return calls
}
