package test

import (
	"bufio"
	"bytes"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/sluicehq/sluice/internal/redistest"
	"github.com/sluicehq/sluice/internal/testkit"
)

// TestReadmeWorkerSnippet: the worker of the README's "Use sluice in your
// own worker" builds as it is (with a sendEmail of the test's) and, given
// a bad config, exits 2 with the key at fault, as the README promises of
// a worker (log.Fatal exited 1); given the README's config beside it (on
// the test's Redis and queue), it runs an email:send task through its
// gates and stops with exit code 0 on SIGTERM.
func TestReadmeWorkerSnippet(t *testing.T) {
	t.Parallel()
	code := docSnippet(t, "README.md", "## Use sluice in your own worker", "go")
	// A directory starting with _ is outside ./... patterns: go vet and the
	// package list never see it.
	dir, err := os.MkdirTemp(".", "_readme-worker-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	stub := "package main\n\nimport \"context\"\n\nfunc sendEmail(context.Context, []byte) error { return nil }\n"
	if err := os.WriteFile(filepath.Join(dir, "main.go"), []byte(code), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "send.go"), []byte(stub), 0o644); err != nil {
		t.Fatal(err)
	}
	binary := filepath.Join(t.TempDir(), "readme-worker")
	if out, err := exec.Command("go", "build", "-o", binary, "./"+filepath.Base(dir)).CombinedOutput(); err != nil {
		t.Fatalf("the README's worker does not build: %v\n%s\n%s", err, out, code)
	}

	run := t.TempDir()
	bad := "redis: {addr: " + redistest.Addr(t) + "}\nqueues:\n  emails: {drain: {limit: -5, period: 1s}}\n"
	if err := os.WriteFile(filepath.Join(run, "config.yaml"), []byte(bad), 0o644); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(binary)
	cmd.Dir = run
	out, err := cmd.CombinedOutput()
	var exit *exec.ExitError
	if !errors.As(err, &exit) || exit.ExitCode() != 2 {
		t.Errorf("the README's worker on a bad config: %v, want exit code 2\n%s", err, out)
	}
	if !strings.Contains(string(out), "queues.emails.drain.limit") {
		t.Errorf("the README's worker on a bad config said %q, want the key queues.emails.drain.limit named", out)
	}
	// A typo under tasks: is found by Run, once the handlers are known:
	// the same exit code.
	typo := "redis: {addr: " + redistest.Addr(t) + "}\nqueues:\n  emails: {}\nquotas:\n  mail-api: {limit: 10, period: 1s}\ntasks:\n  email:sned: {quotas: [mail-api]}\n"
	if err := os.WriteFile(filepath.Join(run, "config.yaml"), []byte(typo), 0o644); err != nil {
		t.Fatal(err)
	}
	cmd = exec.Command(binary)
	cmd.Dir = run
	cmd.Env = append(os.Environ(), "SLUICE_WORKER_METRICS_ADDR="+testkit.FreeAddr(t))
	out, err = cmd.CombinedOutput()
	if !errors.As(err, &exit) || exit.ExitCode() != 2 {
		t.Errorf("the README's worker on a config with a typo under tasks: %v, want exit code 2\n%s", err, out)
	}
	if !strings.Contains(string(out), "email:sned") {
		t.Errorf("the README's worker on a config with a typo under tasks: said %q, want the typo email:sned named", out)
	}

	queue := redistest.Queue(t, "emails")
	config := docSnippet(t, "README.md", "## Use sluice in your own worker", "yaml")
	for from, to := range map[string]string{"redis: {addr: 127.0.0.1:6379}": "redis: {addr: " + redistest.Addr(t) + "}", "\n  emails:": "\n  " + queue + ":"} {
		if !strings.Contains(config, from) {
			t.Fatalf("the README's config has no %q:\n%s", from, config)
		}
		config = strings.Replace(config, from, to, 1)
	}
	if err := os.WriteFile(filepath.Join(run, "config.yaml"), []byte(config), 0o644); err != nil {
		t.Fatal(err)
	}
	var log bytes.Buffer
	cmd = exec.Command(binary)
	cmd.Dir = run
	cmd.Env = append(os.Environ(), "SLUICE_WORKER_METRICS_ADDR="+testkit.FreeAddr(t))
	cmd.Stdout, cmd.Stderr = &log, &log
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	t.Cleanup(func() { cmd.Process.Kill() })
	client := asynq.NewClient(asynq.RedisClientOpt{Addr: redistest.Addr(t)})
	defer client.Close()
	if _, err := client.Enqueue(asynq.NewTask("email:send", []byte(`{"to": "ann@example.com"}`)), asynq.Queue(queue)); err != nil {
		t.Fatal(err)
	}
	testkit.WaitFor(t, 20*time.Second, "the README's worker to run the email:send task", func() bool {
		select {
		case err := <-exited:
			t.Fatalf("the README's worker on the README's config exited: %v\n%s", err, log.String())
		default:
		}
		info := redistest.QueueInfo(t, queue)
		return info.Processed >= 1 && info.Pending == 0 && info.Active == 0
	})
	cmd.Process.Signal(syscall.SIGTERM)
	select {
	case err := <-exited:
		if err != nil {
			t.Errorf("the README's worker stopped by SIGTERM: %v, want exit code 0\n%s", err, log.String())
		}
	case <-time.After(15 * time.Second):
		t.Errorf("the README's worker did not stop within 15 s of SIGTERM")
	}
}

// TestDemoFirstLine: `worker --demo` measures from its first task
// enqueued, so that its first line does not show the tasks drained while
// it enqueued the others as done in its first second: with 3 queues of
// 600 tasks each at 20/s, every rate it prints is at most 20/s + 25%
// (it printed 35/s and more when its clock started after enqueueing).
func TestDemoFirstLine(t *testing.T) {
	t.Parallel()
	queues := []string{redistest.Queue(t, "demo-a"), redistest.Queue(t, "demo-b"), redistest.Queue(t, "demo-c")}
	config := "redis: {addr: " + redistest.Addr(t) + "}\nworker: {concurrency: 10}\nqueues:\n"
	for _, q := range queues {
		config += "  " + q + ": {drain: {algorithm: leaky_bucket, limit: 20, period: 1s, burst: 1}}\n"
	}
	w := startWorkerBinary(t, "worker", []string{"--config", writeConfig(t, config), "--demo", "600"})
	rateRe := regexp.MustCompile(` (\d+)/600 ([0-9.]+)/s \(drain`)
	var lines []string
	testkit.WaitFor(t, 30*time.Second, "3 lines of the demo's progress", func() bool {
		lines = lines[:0]
		f, err := os.Open(w.log)
		if err != nil {
			return false
		}
		defer f.Close()
		for sc := bufio.NewScanner(f); sc.Scan(); {
			if strings.HasPrefix(sc.Text(), "demo ") {
				lines = append(lines, sc.Text())
			}
		}
		return len(lines) >= 3
	})
	for _, line := range lines {
		for _, m := range rateRe.FindAllStringSubmatch(line, -1) {
			if r, _ := strconv.ParseFloat(m[2], 64); r > 25 {
				t.Errorf("the demo printed %.1f/s for a drain of 20/s: %q", r, line)
			}
		}
	}
	t.Logf("the demo's first lines:\n%s", strings.Join(lines, "\n"))
}
