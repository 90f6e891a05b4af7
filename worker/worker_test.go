package worker

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/sluicehq/sluice/config"
	"github.com/sluicehq/sluice/internal/redistest"
	"github.com/sluicehq/sluice/internal/testkit"
)

func writeConfig(t *testing.T, content string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "config.yaml")
	if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

// TestNewProblems: a config with problems is one error from New that lists
// every problem by key.
func TestNewProblems(t *testing.T) {
	path := writeConfig(t, `
redis: {addr: 127.0.0.1:1}
worker: {concurency: 4}
queues:
  emails: {drain: {limit: 0, period: 1s}}
tasks:
  email:send: {quotas: [nope]}
`)
	_, err := New(path)
	var problems *config.Problems
	if !errors.As(err, &problems) {
		t.Fatalf("New(bad config) = %v, want a *config.Problems", err)
	}
	for _, key := range []string{"worker.concurency", "queues.emails.drain.limit", "tasks.email:send.quotas"} {
		if !strings.Contains(err.Error(), key) {
			t.Errorf("the error does not name %s:\n%v", key, err)
		}
	}
	if _, err := New(filepath.Join(t.TempDir(), "missing.yaml")); err == nil || !strings.Contains(err.Error(), "missing.yaml") {
		t.Errorf("New(missing file) = %v, want an error naming the file", err)
	}
	if _, err := New(path, WithShutdownTimeout(0)); err == nil || !strings.Contains(err.Error(), "WithShutdownTimeout") {
		t.Errorf("New(WithShutdownTimeout(0)) = %v, want an error naming the option", err)
	}
}

// TestRun: a custom handler runs through the gates on the real Redis; Run
// returns nil after its context ends, once the running task has finished,
// and refuses to run twice.
func TestRun(t *testing.T) {
	queue := redistest.Queue(t, "lib")
	metrics := testkit.FreeAddr(t)
	path := writeConfig(t, fmt.Sprintf(`
redis: {addr: %s}
worker: {concurrency: 2, metrics_addr: %s}
queues:
  %s: {drain: {limit: 50, period: 1s, burst: 1}}
tasks:
  lib:slow: {}
`, redistest.Addr(t), metrics, queue))
	w, err := New(path, WithLogger(slog.New(slog.DiscardHandler)))
	if err != nil {
		t.Fatal(err)
	}
	var started, finished atomic.Int32
	w.HandleFunc("lib:slow", func(ctx context.Context, _ *asynq.Task) error {
		started.Add(1)
		time.Sleep(300 * time.Millisecond) // still running when ctx below ends
		finished.Add(1)
		return nil
	})
	ctx, cancel := context.WithCancel(context.Background())
	stopped := make(chan error, 1)
	go func() { stopped <- w.Run(ctx) }()

	client := asynq.NewClient(asynq.RedisClientOpt{Addr: redistest.Addr(t)})
	defer client.Close()
	if _, err := client.Enqueue(asynq.NewTask("lib:slow", nil), asynq.Queue(queue), asynq.MaxRetry(0)); err != nil {
		t.Fatal(err)
	}
	testkit.WaitFor(t, 10*time.Second, "the handler to start", func() bool { return started.Load() == 1 })
	cancel()
	select {
	case err := <-stopped:
		if err != nil {
			t.Errorf("Run after its context ended = %v, want nil", err)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("Run did not return within 15s of its context ending")
	}
	if finished.Load() != 1 {
		t.Errorf("Run returned before the running task finished")
	}
	if err := w.Run(context.Background()); err == nil {
		t.Error("a second Run succeeded, want an error")
	}
	if _, err := net.Dial("tcp", metrics); err == nil {
		t.Errorf("the metrics server at %s still answers after Run returned", metrics)
	}
}

// TestRunRefusesTaskTypeTypo: a typo under tasks: (crm:synk for the
// handled crm:sync) would let crm:sync run with no quota: Run refuses to
// start with a *config.Problems naming both, and a reload that makes the
// typo is refused (the log says so, naming it) while a good config runs.
// An entry no handler here takes is logged as a warning with what it
// handles.
func TestRunRefusesTaskTypeTypo(t *testing.T) {
	queue := redistest.Queue(t, "typo")
	configWith := func(taskType string) string {
		return fmt.Sprintf(`
redis: {addr: %s}
worker: {concurrency: 2, metrics_addr: %s}
queues:
  %s: {}
quotas:
  crm: {limit: 5, period: 1s}
tasks:
  %s: {quotas: [crm]}
  crm:push: {}
`, redistest.Addr(t), testkit.FreeAddr(t), queue, taskType)
	}
	path := writeConfig(t, configWith("crm:synk"))
	var log testkit.SyncBuffer
	w, err := New(path, WithLogger(slog.New(slog.NewTextHandler(&log, nil))))
	if err != nil {
		t.Fatal(err)
	}
	w.HandleFunc("crm:sync", func(context.Context, *asynq.Task) error { return nil })
	// Refused at once; a worker that starts runs until the timeout.
	started, cancelStarted := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancelStarted()
	err = w.Run(started)
	var problems *config.Problems
	if !errors.As(err, &problems) || !strings.Contains(err.Error(), "tasks.crm:sync: this worker handles \"crm:sync\", which has no entry under tasks:") ||
		!strings.Contains(err.Error(), "tasks.crm:synk is near it") {
		t.Fatalf("Run with a typo under tasks: = %v, want a *config.Problems naming crm:sync and crm:synk", err)
	}
	t.Logf("Run: %v", err)
	if want := `no handler of this worker takes \"crm:push\" (it handles crm:sync)`; !strings.Contains(log.String(), want) {
		t.Errorf("the log does not warn of crm:push (%s):\n%s", want, log.String())
	}

	path = writeConfig(t, configWith("crm:sync"))
	w, err = New(path, WithLogger(slog.New(slog.NewTextHandler(&log, nil))))
	if err != nil {
		t.Fatal(err)
	}
	w.HandleFunc("crm:sync", func(context.Context, *asynq.Task) error { return nil })
	ctx, cancel := context.WithCancel(context.Background())
	stopped := make(chan error, 1)
	go func() { stopped <- w.Run(ctx) }()
	defer func() { cancel(); <-stopped }()
	testkit.WaitFor(t, 10*time.Second, "the worker to run", func() bool { return strings.Contains(log.String(), "worker running") })
	if err := os.WriteFile(path, []byte(configWith("crm:synk")), 0o644); err != nil {
		t.Fatal(err)
	}
	testkit.WaitFor(t, 10*time.Second, "the reload with a typo to be refused", func() bool {
		return strings.Contains(log.String(), "config change refused") && strings.Contains(log.String(), "tasks.crm:synk is near it")
	})
}
