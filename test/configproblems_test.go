package test

import (
	"context"
	"errors"
	"fmt"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/sluicehq/sluice/config"
	"github.com/sluicehq/sluice/internal/redistest"
	"github.com/sluicehq/sluice/internal/testkit"
	sluiceworker "github.com/sluicehq/sluice/worker"
)

// TestConfigProblems: each kind of mistake in config.yaml or a SLUICE_*
// variable is reported with its key and where it was made (the file's
// line, or the variable), the same by the three entry points that load a
// config: the worker binary and enqueue (exit 2, nothing started) and
// worker.New. Not parallel: the variables are set for the test process,
// which the binaries inherit.
func TestConfigProblems(t *testing.T) {
	const redis = "redis: {addr: 127.0.0.1:1}\n" // line 1 of every file
	for _, tt := range []struct {
		desc, yaml string
		env        []string // name, value
		want       string
	}{
		{desc: "unknown key", yaml: "worker:\n  concurency: 2\n",
			want: "config.yaml:3: worker.concurency: unknown key; known keys here are concurrency, metrics_addr"},
		{desc: "misspelt nested key", yaml: "queues:\n  emails:\n    drain:\n      limit: 5\n      period: 1s\n      brust: 2\n",
			want: "config.yaml:7: queues.emails.drain.brust: unknown key"},
		{desc: "wrong type", yaml: "worker:\n  concurrency: ten\n",
			want: `config.yaml:3: worker.concurrency: must be a whole number, got "ten"`},
		{desc: "wrong shape", yaml: "queues: [emails]\n",
			want: "config.yaml:2: queues: must be a mapping of names, got a list"},
		{desc: "negative limit", yaml: "queues:\n  emails:\n    drain: {limit: -3, period: 1s}\n",
			want: "config.yaml:4: queues.emails.drain.limit: must be > 0, got -3"},
		{desc: "zero period", yaml: "quotas:\n  api:\n    limit: 5\n    period: 0s\n",
			want: "config.yaml:5: quotas.api.period: must be at least 1ms, got 0µs"},
		{desc: "bad duration", yaml: "worker:\n  hold_max: soon\n",
			want: `config.yaml:3: worker.hold_max: must be a duration with a unit, like 1s, 500ms or 5m, got "soon"`},
		{desc: "unknown algorithm", yaml: "quotas:\n  api: {algorithm: token-bucket, limit: 1, period: 1s}\n",
			want: `config.yaml:3: quotas.api.algorithm: must be one of`},
		{desc: "windows that do not divide the period", yaml: "quotas:\n  api:\n    algorithm: sliding_counter\n    limit: 5\n    period: 1s\n    windows: 7\n",
			want: "config.yaml:7: quotas.api.windows: must divide Period"},
		{desc: "unknown quota named by a task", yaml: "tasks:\n  crm:sync:\n    quotas: [nope]\n",
			want: `config.yaml:4: tasks.crm:sync.quotas: names quota "nope"`},
		{desc: "key set twice", yaml: "worker:\n  concurrency: 1\n  concurrency: 2\n",
			want: "config.yaml:4: worker.concurrency: set twice; first at line 3"},
		{desc: "bad list item", yaml: "gateway:\n  limits:\n    - {name: a, key: ip, limit: 1, period: 1s}\n    - {name: b, key: user, limit: 1, period: 1s}\n",
			want: `config.yaml:5: gateway.limits[1].key: must be global, client, ip or type, got "user"`},
		{desc: "key the file leaves out", yaml: "gateway:\n  ban:\n    after: 3\n    for: 5m\n",
			want: "config.yaml:3: gateway.ban.within: must be > 0 when gateway.ban.after is set"},
		{desc: "a name keeps its case", yaml: "queues:\n  Emails: {drain: {limit: 0, period: 1s}}\n",
			want: "config.yaml:3: queues.Emails.drain.limit: must be > 0, got 0"},
		{desc: "bad variable value", yaml: "queues:\n  emails:\n    drain: {limit: 5, period: 1s}\n",
			env:  []string{"SLUICE_QUEUES_EMAILS_DRAIN_LIMIT", "-3"},
			want: "SLUICE_QUEUES_EMAILS_DRAIN_LIMIT: queues.emails.drain.limit: must be > 0, got -3"},
		{desc: "variable not a number", yaml: "",
			env:  []string{"SLUICE_WORKER_CONCURRENCY", "ten"},
			want: `SLUICE_WORKER_CONCURRENCY: worker.concurrency: must be a whole number, got "ten"`},
	} {
		t.Run(tt.desc, func(t *testing.T) {
			if tt.env != nil {
				t.Setenv(tt.env[0], tt.env[1])
			}
			path := writeConfig(t, redis+tt.yaml)
			for _, args := range [][]string{{"worker", "--config", path}, {"enqueue", "--config", path, "demo:noop", "{}"}} {
				code, stderr := runBriefly(t, args...)
				if code != 2 || !strings.Contains(stderr, tt.want) {
					t.Errorf("%s: exit %d, want 2 and %q:\n%s", args[0], code, tt.want, stderr)
				}
			}
			_, err := sluiceworker.New(path)
			var problems *config.Problems
			var problem *config.Problem
			if !errors.As(err, &problems) || !errors.As(err, &problem) || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("worker.New = %v, want a *config.Problems with %q", err, tt.want)
			}
		})
	}
}

// runBriefly runs a binary of bin with args, as a process that should stop
// at once, and returns its exit code and stderr.
func runBriefly(t *testing.T, args ...string) (int, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, filepath.Join(bin, args[0]), args[1:]...)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	err := cmd.Run()
	var exit *exec.ExitError
	if err != nil && !errors.As(err, &exit) {
		t.Fatalf("running %q: %v", args, err)
	}
	return cmd.ProcessState.ExitCode(), stderr.String()
}

// TestQueueNamesKeepTheirCase: queues named Mail and mail in config.yaml
// are two queues, as asynq has them: enqueue takes both names, and a
// worker serves both, each task run from the queue it was enqueued to.
func TestQueueNamesKeepTheirCase(t *testing.T) {
	t.Parallel()
	addr := redistest.Addr(t)
	upper, lower := redistest.Queue(t, "Mail"), redistest.Queue(t, "mail")
	path := writeConfig(t, fmt.Sprintf("redis: {addr: %s}\nqueues:\n  %s: {priority: 2}\n  %s: {}\n", addr, upper, lower))
	for _, q := range []string{upper, lower} {
		if r := runEnqueue(t, addr, nil, "--config", path, "--queue", q, "--count", "3", "demo:noop", "{}"); r.code != 0 || strings.Contains(r.stderr, "warning") {
			t.Fatalf("enqueue --queue %s: want exit 0 and no warning\n%v", q, r)
		}
	}
	startWorker(t, path)
	testkit.WaitFor(t, 20*time.Second, "3 tasks run from each queue", func() bool {
		return redistest.QueueInfo(t, upper).ProcessedTotal >= 3 && redistest.QueueInfo(t, lower).ProcessedTotal >= 3
	})
}
