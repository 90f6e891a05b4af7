package test

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/sluicehq/sluice/internal/redistest"
	"github.com/sluicehq/sluice/internal/testkit"
)

// intake is a running `enqueue serve`.
type intakeServer struct {
	url string
}

// startIntake runs `enqueue serve` on a config whose gateway section is
// gateway, and waits until it answers.
func startIntake(t *testing.T, gateway string) *intakeServer {
	t.Helper()
	addr := freeAddr(t)
	config := writeConfig(t, fmt.Sprintf("redis: {addr: %s}\ngateway:\n  listen: %s\n%s", redisAddr(t), addr, gateway))
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
	s := &intakeServer{url: "http://" + addr}
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
	body := fmt.Sprintf(`{"type": "demo:noop", "queue": %q}`, queue)
	req, _ := http.NewRequest("POST", s.url+"/v1/tasks", bytes.NewBufferString(body))
	if client != "" {
		req.Header.Set("X-API-Key", client)
	}
	for k, v := range headers {
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var answer struct{ ID string }
	json.NewDecoder(resp.Body).Decode(&answer)
	retryAfter, _ = strconv.Atoi(resp.Header.Get("Retry-After"))
	return resp.StatusCode, retryAfter, answer.ID
}

// limitName gives a test's limits names of their own: the limits' state in
// Redis is keyed by name.
func limitName(t *testing.T, name string) string {
	return fmt.Sprintf("%s-%x", name, rand.Uint32())
}

func TestIntakeRetryAfter(t *testing.T) {
	s := startIntake(t, fmt.Sprintf(`  limits:
    - {name: %s, key: client, algorithm: sliding_log, limit: 3, period: 2s}
`, limitName(t, "per-client")))
	queue := redistest.Queue(t, "q")
	for i := 0; i < 3; i++ {
		if status, _, _ := s.post(t, "alice", queue, nil); status != http.StatusAccepted {
			t.Fatalf("request %d: %d, want 202", i, status)
		}
	}
	status, retryAfter, _ := s.post(t, "alice", queue, nil)
	if status != http.StatusTooManyRequests || retryAfter < 1 || retryAfter > 2 {
		t.Fatalf("4th request: %d with Retry-After %d, want 429 within the 2s window", status, retryAfter)
	}
	if status, _, _ := s.post(t, "bob", queue, nil); status != http.StatusAccepted {
		t.Fatalf("another client: %d, want 202", status)
	}
	time.Sleep(time.Duration(retryAfter) * time.Second)
	if status, _, _ := s.post(t, "alice", queue, nil); status != http.StatusAccepted {
		t.Fatalf("after waiting Retry-After %ds: %d, want 202", retryAfter, status)
	}
}

// TestIntakeAllOrNothing: refusals by per-client use up nothing of overall
// or per-ip, so another client from the same address still gets all that
// is left of them.
func TestIntakeAllOrNothing(t *testing.T) {
	s := startIntake(t, fmt.Sprintf(`  limits:
    - {name: %s, key: global, algorithm: token_bucket, limit: 10, period: 1m}
    - {name: %s, key: client, algorithm: sliding_log, limit: 3, period: 1m}
    - {name: %s, key: ip, algorithm: sliding_counter, limit: 10, period: 1m}
`, limitName(t, "overall"), limitName(t, "per-client"), limitName(t, "per-ip")))
	queue := redistest.Queue(t, "q")
	accepted := func(client string, n int) int {
		ok := 0
		for i := 0; i < n; i++ {
			if status, _, _ := s.post(t, client, queue, nil); status == http.StatusAccepted {
				ok++
			}
		}
		return ok
	}
	if got := accepted("alice", 8); got != 3 {
		t.Fatalf("alice: %d of 8 accepted, want her per-client 3", got)
	}
	// Twelve more clients from the same address, one request each.
	others := 0
	for i := 0; i < 12; i++ {
		others += accepted(fmt.Sprint("client-", i), 1)
	}
	if others != 7 {
		t.Fatalf("after alice's 5 refusals, %d of 12 other clients accepted, want the 7 left of overall and per-ip", others)
	}
}

// TestIntakeForwardedFor: X-Forwarded-For from a peer that is not a trusted
// proxy is not believed: 1,000 requests with random addresses in it are one
// client for the per-ip limit.
func TestIntakeForwardedFor(t *testing.T) {
	s := startIntake(t, fmt.Sprintf(`  limits:
    - {name: %s, key: ip, algorithm: sliding_log, limit: 50, period: 1m}
`, limitName(t, "per-ip")))
	queue := redistest.Queue(t, "q")
	ok := 0
	for i := 0; i < 1000; i++ {
		xff := fmt.Sprintf("%d.%d.%d.%d", rand.IntN(223)+1, rand.IntN(256), rand.IntN(256), rand.IntN(256))
		if status, _, _ := s.post(t, "", queue, map[string]string{"X-Forwarded-For": xff}); status == http.StatusAccepted {
			ok++
		}
	}
	if ok != 50 {
		t.Fatalf("%d of 1,000 requests with random X-Forwarded-For accepted, want the one client's 50", ok)
	}
}

// TestIntakeBan: a client refused 3 times within a minute is banned for 2s,
// refused throughout without touching the limits, and banned for twice as
// long the next time.
func TestIntakeBan(t *testing.T) {
	s := startIntake(t, fmt.Sprintf(`  limits:
    - {name: %s, key: client, algorithm: sliding_log, limit: 2, period: 1s}
  ban: {after: 3, within: 1m, for: 2s, max: 8s}
`, limitName(t, "per-client")))
	queue := redistest.Queue(t, "q")
	ban := func() (retryAfter int) {
		for i := 0; i < 5; i++ {
			s.post(t, "mallory", queue, nil)
		}
		status, retryAfter, _ := s.post(t, "mallory", queue, nil)
		if status != http.StatusTooManyRequests {
			t.Fatalf("after hammering: %d, want 429", status)
		}
		return retryAfter
	}
	first := ban()
	if first < 1 || first > 2 {
		t.Fatalf("first ban: Retry-After %d, want up to 2", first)
	}
	// The per-client window (1s) passes, the ban (2s) holds.
	time.Sleep(1100 * time.Millisecond)
	if status, _, _ := s.post(t, "mallory", queue, nil); status != http.StatusTooManyRequests {
		t.Fatalf("during the ban, after the limit's window: %d, want 429", status)
	}
	if status, _, _ := s.post(t, "someone-else", queue, nil); status != http.StatusAccepted {
		t.Fatalf("another client during the ban: %d, want 202", status)
	}
	time.Sleep(time.Second)
	if status, _, _ := s.post(t, "mallory", queue, nil); status != http.StatusAccepted {
		t.Fatalf("after the ban: %d, want 202", status)
	}
	if second := ban(); second <= first || second > 4 {
		t.Fatalf("second ban: Retry-After %d, want longer than the first (%d), up to 4", second, first)
	}
}

// TestIntakeConcurrentClients: 200 clients at once; every task answered 202
// is in Redis.
func TestIntakeConcurrentClients(t *testing.T) {
	s := startIntake(t, fmt.Sprintf(`  limits:
    - {name: %s, key: global, algorithm: token_bucket, limit: 1000, period: 1s, burst: 1000}
    - {name: %s, key: client, algorithm: sliding_log, limit: 5, period: 1m}
`, limitName(t, "overall"), limitName(t, "per-client")))
	queue := redistest.Queue(t, "q")
	var mu sync.Mutex
	var ids []string
	var wg sync.WaitGroup
	for c := 0; c < 200; c++ {
		wg.Go(func() {
			status, _, id := s.post(t, fmt.Sprint("client-", c), queue, nil)
			if status == http.StatusAccepted {
				mu.Lock()
				ids = append(ids, id)
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	if len(ids) != 200 {
		t.Fatalf("%d of 200 clients accepted, want all", len(ids))
	}
	inspector := asynq.NewInspector(asynq.RedisClientOpt{Addr: redistest.Addr(t)})
	defer inspector.Close()
	for _, id := range ids {
		if _, err := inspector.GetTaskInfo(queue, id); err != nil {
			t.Errorf("task %s answered 202 is not in Redis: %v", id, err)
		}
	}
}
