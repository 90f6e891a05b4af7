package test

import (
	"fmt"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/sluicehq/sluice/internal/redistest"
	"github.com/sluicehq/sluice/internal/testkit"
)

// exampleConfig is the config of the example worker for these tests:
// queue drained at rate a second; forecast:fetch draws on a quota far
// above it, so that the gates compose, and has the example's schema.
func exampleConfig(t *testing.T, queue string, rate int) string {
	schema, err := filepath.Abs("../examples/forecast/schema.json")
	if err != nil {
		t.Fatal(err)
	}
	return fmt.Sprintf(`
redis: {addr: %s}
worker: {concurrency: 10}
queues:
  %s: {drain: {algorithm: leaky_bucket, limit: %d, period: 1s, burst: 1}}
quotas:
  %s: {algorithm: token_bucket, limit: 1000, period: 1s, burst: 50}
tasks:
  forecast:fetch: {quotas: [%[4]s], schema: %s}
`, redistest.Addr(t), queue, rate, redistest.Queue(t, "weather-api"), schema)
}

// runProducer runs the example producer (a plain asynq.Client).
func runProducer(t *testing.T, args ...string) {
	t.Helper()
	out, err := exec.Command(filepath.Join(bin, "examples", "producer"), append([]string{"--redis", redistest.Addr(t)}, args...)...).CombinedOutput()
	if err != nil {
		t.Fatalf("producer %q: %v\n%s", args, err, out)
	}
}

// TestExampleWorker: the example worker (examples/worker, built on package
// worker, outside cmd/) in two processes drains its custom type at the
// queue's rate: 400 tasks from the example producer (a plain
// asynq.Client), half with MaxRetry 0, at 20/s within 2%, every one run
// once, none archived, retried or failed. Then the rate in the file goes
// to 40/s with 200 tasks left: in force within 2 s.
func TestExampleWorker(t *testing.T) {
	t.Parallel()
	const measured, more = 400, 200
	u := newUpstream(t)
	queue := redistest.Queue(t, "forecasts")
	path := writeConfig(t, exampleConfig(t, queue, 20))
	var fleet []*worker
	for range 2 {
		fleet = append(fleet, startWorkerBinary(t, "examples/worker", []string{"--config", path, "--api", u.URL}))
	}
	runProducer(t, "--queue", queue, "--count", fmt.Sprint((measured+more)/2), "--max-retry", "0")
	runProducer(t, "--queue", queue, "--count", fmt.Sprint((measured+more)/2), "--first", fmt.Sprint((measured+more)/2))

	testkit.WaitFor(t, 40*time.Second, "the first 400 requests", func() bool { return len(u.Under("forecast")) >= measured })
	replace(t, path, exampleConfig(t, queue, 40))
	changed := time.Now()
	testkit.WaitFor(t, 30*time.Second, "every request", func() bool { return len(u.Under("forecast")) >= measured+more })
	time.Sleep(500 * time.Millisecond) // let any duplicate show itself

	arrivals := u.Under("forecast")
	first := rate(arrivals[:measured])
	after := rate(between(arrivals, changed.Add(2*time.Second), arrivals[len(arrivals)-1].Add(time.Nanosecond)))
	var done float64
	for _, w := range fleet {
		done += w.counter(t, "sluice_tasks_processed_total", `type="forecast:fetch"`, `result="ok"`)
	}
	t.Logf("2 example workers: %d requests; the first %d at %.3f/s (20/s configured); %.2f/s from 2 s after the change to 40/s; %.0f counted ok",
		len(arrivals), measured, first, after, done)
	if len(arrivals) != measured+more || u.Distinct() != measured+more {
		t.Errorf("%d requests for %d distinct tasks, want %d of %d: tasks lost or run twice", len(arrivals), u.Distinct(), measured+more, measured+more)
	}
	if first < 19.6 || first > 20.4 {
		t.Errorf("drained at %.3f/s, want 20/s within 2%%", first)
	}
	if after < 38 || after > 42 {
		t.Errorf("%.2f/s from 2 s after the change to 40/s, want 40/s within 5%%", after)
	}
	if done != measured+more {
		t.Errorf("the workers counted %.0f forecast:fetch tasks ok, want %d", done, measured+more)
	}
	info := redistest.QueueInfo(t, queue)
	if info.Archived != 0 || info.Retry != 0 || info.Failed != 0 || info.Pending != 0 || info.Scheduled != 0 || info.Active != 0 {
		t.Errorf("queue after the run: archived %d, retry %d, failed today %d, pending %d, scheduled %d, active %d; want all 0",
			info.Archived, info.Retry, info.Failed, info.Pending, info.Scheduled, info.Active)
	}
}

// TestVersion: both commands tell the module and the build's revision.
func TestVersion(t *testing.T) {
	t.Parallel()
	for _, command := range []string{"worker", "enqueue"} {
		out, err := exec.Command(filepath.Join(bin, command), "--version").CombinedOutput()
		if err != nil || !strings.HasPrefix(string(out), "github.com/sluicehq/sluice ") || !strings.Contains(string(out), "revision ") {
			t.Errorf("%s --version: %v\n%s\nwant the module path and the revision", command, err, out)
		}
		for _, shell := range []string{"bash", "zsh", "fish", "powershell"} {
			out, err := exec.Command(filepath.Join(bin, command), "completion", shell).Output()
			if err != nil || !strings.Contains(string(out), command) {
				t.Errorf("%s completion %s: %v\n%s", command, shell, err, tail(string(out), 5))
			}
		}
	}
}
