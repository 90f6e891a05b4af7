// Producers as processes: the enqueue command run to its end, the intake
// (enqueue serve) started, and what they left in Redis read back.

package test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/internal/redistest"
	"github.com/sluicehq/sluice/internal/testkit"
)

// enqueueRun is a finished run of bin/enqueue.
type enqueueRun struct {
	stdout, stderr string
	code           int
	peakRSS        int64 // the process's peak resident memory in bytes, as last seen while it ran
}

// runEnqueue runs bin/enqueue with args against the Redis at addr (through
// SLUICE_REDIS_ADDR: the config files of these tests point elsewhere, so a
// run that ignored the variable would fail) and stdin, if not nil.
func runEnqueue(t *testing.T, addr string, stdin io.Reader, args ...string) enqueueRun {
	t.Helper()
	cmd := exec.Command(filepath.Join(bin, "enqueue"), args...)
	cmd.Env = append(os.Environ(), "SLUICE_REDIS_ADDR="+addr)
	cmd.Stdin = stdin
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Start(); err != nil {
		t.Fatalf("running enqueue %q: %v", args, err)
	}
	stop := make(chan struct{})
	peak := make(chan int64)
	go func() { peak <- watchPeakRSS(cmd.Process.Pid, filepath.Join(bin, "enqueue"), stop) }()
	err := cmd.Wait()
	close(stop)
	var exit *exec.ExitError
	if err != nil && !errors.As(err, &exit) {
		t.Fatalf("running enqueue %q: %v", args, err)
	}
	return enqueueRun{stdout.String(), stderr.String(), cmd.ProcessState.ExitCode(), <-peak}
}

// watchPeakRSS reads the peak resident memory of process pid (VmHWM) every
// few milliseconds until stop is closed, and returns the last reading
// taken while the process ran binary. The rusage of a finished child
// cannot serve: Linux counts in it the peak of the test process it was
// forked from.
func watchPeakRSS(pid int, binary string, stop <-chan struct{}) int64 {
	var peak int64
	tick := time.NewTicker(5 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-stop:
			return peak
		case <-tick.C:
		}
		if exe, err := os.Readlink(fmt.Sprintf("/proc/%d/exe", pid)); err != nil || exe != binary {
			continue
		}
		status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
		if err != nil {
			continue
		}
		for line := range strings.SplitSeq(string(status), "\n") {
			if kb, ok := strings.CutPrefix(line, "VmHWM:"); ok {
				if n, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(kb), "kB")), 10, 64); err == nil {
					peak = n << 10
				}
			}
		}
	}
}

func (r enqueueRun) String() string {
	return fmt.Sprintf("exit %d\nstdout:\n%s\nstderr:\n%s", r.code, tail(r.stdout, 20), tail(r.stderr, 30))
}

// enqueueConfig writes a config whose redis.addr is unreachable (the tests
// set SLUICE_REDIS_ADDR) and whose queues are queues, each with a drain.
func enqueueConfig(t *testing.T, queues ...string) string {
	t.Helper()
	var b strings.Builder
	b.WriteString("redis: {addr: 127.0.0.1:1}\n")
	if len(queues) > 0 {
		b.WriteString("queues:\n")
		for _, q := range queues {
			fmt.Fprintf(&b, "  %s: {drain: {algorithm: leaky_bucket, limit: 20, period: 1s, burst: 2}}\n", q)
		}
	}
	return writeConfig(t, b.String())
}

// writeLines writes n lines, line(1) to line(n), to a file and returns its
// path.
func writeLines(t *testing.T, n int, line func(i int) string) string {
	t.Helper()
	var b bytes.Buffer
	for i := 1; i <= n; i++ {
		b.WriteString(line(i))
		b.WriteByte('\n')
	}
	path := filepath.Join(t.TempDir(), "tasks.jsonl")
	if err := os.WriteFile(path, b.Bytes(), 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

// queueSize is how many tasks the queue holds in any state; 0 for a queue
// asynq does not know.
func queueSize(t *testing.T, addr, queue string) int {
	t.Helper()
	inspector := asynq.NewInspector(asynq.RedisClientOpt{Addr: addr})
	defer inspector.Close()
	queues, err := inspector.Queues()
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(queues, queue) {
		return 0
	}
	info, err := inspector.GetQueueInfo(queue)
	if err != nil {
		t.Fatal(err)
	}
	return info.Size + info.Completed
}

// taskIDs returns the ids of the tasks of queue, from asynq's task keys.
func taskIDs(t *testing.T, addr, queue string) map[string]bool {
	t.Helper()
	rdb := redis.NewClient(&redis.Options{Addr: addr})
	defer rdb.Close()
	prefix := "asynq:{" + queue + "}:t:"
	ids := map[string]bool{}
	iter := rdb.Scan(context.Background(), 0, prefix+"*", 10_000).Iterator()
	for iter.Next(context.Background()) {
		ids[strings.TrimPrefix(iter.Val(), prefix)] = true
	}
	if err := iter.Err(); err != nil {
		t.Fatal(err)
	}
	return ids
}

func fileMB(t *testing.T, path string) int64 {
	t.Helper()
	st, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	return st.Size() >> 20
}

// deleteQueue removes a test's queue and its tasks, so that large tests
// leave Redis as they found it.
func deleteQueue(t *testing.T, addr, queue string) {
	t.Helper()
	inspector := asynq.NewInspector(asynq.RedisClientOpt{Addr: addr})
	defer inspector.Close()
	if err := inspector.DeleteQueue(queue, true); err != nil {
		t.Errorf("deleting queue %s: %v", queue, err)
	}
}

// intakeServer is a running `enqueue serve`.
type intakeServer struct {
	url     string // the public listener
	metrics string // the metrics listener
	config  string // the path of its config file
	log     string // the path of its log
}

// startIntake runs `enqueue serve` on a config whose gateway section is
// gateway (indented by two spaces) and whose queues are queues, and waits
// until it answers.
func startIntake(t *testing.T, gateway string, queues ...string) *intakeServer {
	t.Helper()
	return startIntakeOn(t, testkit.FreeAddr(t), gateway, queues...)
}

// startIntakeOn is startIntake serving on addr, an IPv4 host:port; its
// requests go to addr's port on 127.0.0.1 (so an intake on 0.0.0.0 is
// reached over loopback only).
func startIntakeOn(t *testing.T, addr, gateway string, queues ...string) *intakeServer {
	t.Helper()
	metrics := testkit.FreeAddr(t)
	var b strings.Builder
	fmt.Fprintf(&b, "redis: {addr: %s}\n", redistest.Addr(t))
	if len(queues) > 0 {
		b.WriteString("queues:\n")
		for _, q := range queues {
			fmt.Fprintf(&b, "  %s: {}\n", q)
		}
	}
	fmt.Fprintf(&b, "gateway:\n  listen: %s\n  metrics_addr: %s\n%s", addr, metrics, gateway)
	config := writeConfig(t, b.String())
	logPath := filepath.Join(t.TempDir(), "serve.log")
	logFile, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(filepath.Join(bin, "enqueue"), "serve", "--config", config)
	cmd.Stdout, cmd.Stderr = logFile, logFile
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Signal(syscall.SIGTERM)
		cmd.Wait()
		logFile.Close()
		if t.Failed() {
			b, _ := os.ReadFile(logPath)
			t.Logf("enqueue serve log:\n%s", tail(string(b), 30))
		}
	})
	_, port, _ := net.SplitHostPort(addr)
	s := &intakeServer{url: "http://127.0.0.1:" + port, metrics: "http://" + metrics, config: config, log: logPath}
	testkit.WaitFor(t, 15*time.Second, "enqueue serve to answer", func() bool {
		resp, err := http.Get(s.url + "/healthz")
		if err == nil {
			resp.Body.Close()
		}
		return err == nil
	})
	return s
}

// post sends one task request as client (X-API-Key, "" for none) with
// headers, and returns the status, the Retry-After and the task id.
func (s *intakeServer) post(t *testing.T, client, queue string, headers map[string]string) (status, retryAfter int, id string) {
	t.Helper()
	if client != "" {
		headers = with(headers, "X-API-Key", client)
	}
	resp, body := s.do(t, fmt.Sprintf(`{"type": "demo:noop", "queue": %q}`, queue), headers)
	var answer struct{ ID string }
	json.Unmarshal(body, &answer)
	retryAfter, _ = strconv.Atoi(resp.Header.Get("Retry-After"))
	return resp.StatusCode, retryAfter, answer.ID
}

// send posts body as one task request with headers, and returns the
// status and the answer's body.
func (s *intakeServer) send(t *testing.T, body string, headers map[string]string) (int, string) {
	t.Helper()
	resp, answer := s.do(t, body, headers)
	return resp.StatusCode, string(answer)
}

// do posts body to /v1/tasks with headers and returns the answer, its body
// read.
func (s *intakeServer) do(t *testing.T, body string, headers map[string]string) (*http.Response, []byte) {
	t.Helper()
	req, _ := http.NewRequest("POST", s.url+"/v1/tasks", strings.NewReader(body))
	for k, v := range headers {
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	answer, _ := io.ReadAll(resp.Body)
	return resp, answer
}
