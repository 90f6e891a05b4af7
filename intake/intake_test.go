package intake_test

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/hibiken/asynq"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/sluicehq/sluice/config"
	"github.com/sluicehq/sluice/intake"
	"github.com/sluicehq/sluice/internal/redistest"
	"github.com/sluicehq/sluice/jobs"
)

// loadConfig writes yaml to a config file of the test's own and loads it,
// as enqueue serve does.
func loadConfig(t *testing.T, yaml string) config.File {
	t.Helper()
	path := filepath.Join(t.TempDir(), "config.yaml")
	if err := os.WriteFile(path, []byte(yaml), 0o644); err != nil {
		t.Fatal(err)
	}
	f, err := config.Load(path)
	if err != nil {
		t.Fatal(err)
	}
	return f
}

func keyHash(key string) string {
	sum := sha256.Sum256([]byte(key))
	return hex.EncodeToString(sum[:])
}

// TestIntake runs an Intake in process, built from a config as enqueue
// serve builds it, and checks each answer of its API: 202 with the task in
// Redis carrying its client's name, 400 naming the field at fault, 401
// without a key, 403 for a queue the client may not use, 409 for a task id
// taken, and 429 with Retry-After once the client's limit of 6 a minute is
// spent; and that every answer of its own is counted by its code.
func TestIntake(t *testing.T) {
	q1, q2 := redistest.Queue(t, "q1"), redistest.Queue(t, "q2")
	limit := fmt.Sprintf("per-client-%x", rand.Uint32()) // the limit's state in Redis is keyed by its name
	f := loadConfig(t, fmt.Sprintf(`redis: {addr: %s}
queues:
  %s: {}
  %s: {}
gateway:
  limits:
    - {name: %s, key: client, algorithm: fixed_window, limit: 6, period: 1m}
  clients:
    - {name: alice, key_sha256: %s, queues: [%s]}
`, redistest.Addr(t), q1, q2, limit, keyHash("alice-secret"), q1))
	client := asynq.NewClient(f.Redis.AsynqOpt())
	defer client.Close()
	inspector := asynq.NewInspector(f.Redis.AsynqOpt())
	defer inspector.Close()
	t.Cleanup(func() {
		inspector.DeleteQueue(q1, true)
		inspector.DeleteQueue(q2, true)
	})
	reg := prometheus.NewRegistry()
	in, err := intake.New(f, redistest.Client(t), client, intake.WithRegisterer(reg), intake.WithLogger(slog.New(slog.DiscardHandler)))
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(in)
	defer srv.Close()

	post := func(key, body string) (*http.Response, map[string]any) {
		t.Helper()
		req, _ := http.NewRequest("POST", srv.URL+"/v1/tasks", strings.NewReader(body))
		if key != "" {
			req.Header.Set(intake.APIKeyHeader, key)
		}
		resp, err := srv.Client().Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var answer map[string]any
		if err := json.NewDecoder(resp.Body).Decode(&answer); err != nil {
			t.Fatalf("POST %s: %s, its body not JSON: %v", body, resp.Status, err)
		}
		return resp, answer
	}
	noop := func(q string, options string) string {
		return fmt.Sprintf(`{"type": "demo:noop", "queue": %q, "options": {%s}}`, q, options)
	}

	resp, err := srv.Client().Get(srv.URL + "/healthz")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || string(body) != "ok\n" {
		t.Errorf("GET /healthz: %d %q, want 200 ok", resp.StatusCode, body)
	}

	// The 401s are answered before the limits are checked; a bad body
	// (400) after them, so that a limit of key "type" can count it as
	// "invalid": each 400 spends one of alice's 6.
	for _, c := range []struct {
		desc, key, body string
		status          int
		want            string // in the answer's "error"
	}{
		{desc: "no key", body: noop(q1, ""), status: http.StatusUnauthorized, want: "an API key is required"},
		{desc: "an unknown key", key: "guess", body: noop(q1, ""), status: http.StatusUnauthorized, want: "unknown API key"},
		{desc: "not JSON", key: "alice-secret", body: `{"type": `, status: http.StatusBadRequest, want: "invalid JSON"},
		{desc: "a bad option", key: "alice-secret", body: noop(q1, `"max_retry": -1`), status: http.StatusBadRequest, want: "options.max_retry: must be >= 0, got -1"},
		{desc: "a payload against its type's rules", key: "alice-secret", body: fmt.Sprintf(`{"type": "demo:sleep", "queue": %q, "payload": {"ms": "long"}}`, q1),
			status: http.StatusBadRequest, want: `demo:sleep: payload: field "ms"`},
	} {
		resp, answer := post(c.key, c.body)
		if resp.StatusCode != c.status || !strings.Contains(fmt.Sprint(answer["error"]), c.want) {
			t.Errorf("%s: %d %v, want %d saying %q", c.desc, resp.StatusCode, answer, c.status, c.want)
		}
	}

	// Three more pass the limit, whatever is answered after it; the next is
	// refused.
	resp, answer := post("alice-secret", noop(q1, `"task_id": "t-1"`))
	if resp.StatusCode != http.StatusAccepted || answer["id"] != "t-1" || answer["queue"] != q1 {
		t.Fatalf("alice's task: %d %v, want 202 with id t-1 in %s", resp.StatusCode, answer, q1)
	}
	info, err := inspector.GetTaskInfo(q1, "t-1")
	if err != nil {
		t.Fatalf("the accepted task is not in Redis: %v", err)
	}
	if got := info.Headers[jobs.HeaderClient]; got != "alice" {
		t.Errorf("the task's %s header: %q, want alice", jobs.HeaderClient, got)
	}
	if resp, answer := post("alice-secret", noop(q1, `"task_id": "t-1"`)); resp.StatusCode != http.StatusConflict || answer["id"] != "t-1" {
		t.Errorf("the same task id again: %d %v, want 409 naming t-1", resp.StatusCode, answer)
	}
	if resp, answer := post("alice-secret", noop(q2, "")); resp.StatusCode != http.StatusForbidden || !strings.Contains(fmt.Sprint(answer["error"]), `client "alice" may not enqueue to`) {
		t.Errorf("alice in a queue not hers: %d %v, want 403", resp.StatusCode, answer)
	}
	resp, answer = post("alice-secret", noop(q1, ""))
	if resp.StatusCode != http.StatusTooManyRequests || resp.Header.Get("Retry-After") == "" {
		t.Errorf("alice's seventh request within a minute: %d %v (Retry-After %q), want 429 with Retry-After", resp.StatusCode, answer, resp.Header.Get("Retry-After"))
	}
	if n, err := inspector.GetQueueInfo(q1); err != nil || n.Pending != 1 {
		t.Errorf("queue %s: %+v %v, want the one task accepted", q1, n, err)
	}

	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	counted := map[string]float64{}
	for _, family := range families {
		if family.GetName() != "sluice_intake_requests_total" {
			continue
		}
		for _, m := range family.GetMetric() {
			counted[m.GetLabel()[0].GetValue()] = m.GetCounter().GetValue()
		}
	}
	// The 429 is the limits' answer, counted by their own metrics.
	if want := map[string]float64{"202": 1, "400": 3, "401": 2, "403": 1, "409": 1}; !maps.Equal(counted, want) {
		t.Errorf("sluice_intake_requests_total by code: %v, want %v", counted, want)
	}
}
