package intake_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/intake"
	"github.com/sluicehq/sluice/internal/redistest"
)

// adminIntake serves an intake whose config has the queue q (drain 5/s)
// and, if token is not "", the admin token token; on database 6 of the
// test server, emptied first (the runtime limits and the bans are the
// fleet's keys).
func adminIntake(t *testing.T, token string) (*httptest.Server, redis.UniversalClient) {
	t.Helper()
	rdb := redis.NewClient(&redis.Options{Addr: redistest.Addr(t), DB: 6})
	t.Cleanup(func() { rdb.Close() })
	if err := rdb.FlushDB(context.Background()).Err(); err != nil {
		t.Fatal(err)
	}
	admin := ""
	if token != "" {
		admin = "admin_token_hash: " + keyHash(token)
	}
	f := loadConfig(t, fmt.Sprintf(`redis: {addr: %s, db: 6}
queues:
  q: {drain: {limit: 5, period: 1s, burst: 1}}
gateway:
  ban: {after: 3, within: 1m, for: 1m}
  %s
`, redistest.Addr(t), admin))
	client := asynq.NewClient(f.Redis.AsynqOpt())
	t.Cleanup(func() { client.Close() })
	in, err := intake.New(f, rdb, client, intake.WithLogger(slog.New(slog.DiscardHandler)))
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(in)
	t.Cleanup(srv.Close)
	return srv, rdb
}

// call sends method path with body (if not "") and the admin token (if not
// ""), and returns the status and the JSON answer.
func call(t *testing.T, srv *httptest.Server, method, path, token, body string) (int, map[string]any) {
	t.Helper()
	req, err := http.NewRequest(method, srv.URL+path, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := srv.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	var answer map[string]any
	json.Unmarshal(raw, &answer)
	return resp.StatusCode, answer
}

// TestAdminLimits (issue 22.2): the admin API sets, lists and resets a
// gate's limit and shows its history with the admin token; without it, or
// with a wrong one, 401 and nothing changes; a bad body is 400 naming the
// field.
func TestAdminLimits(t *testing.T) {
	const token = "admin-secret"
	srv, rdb := adminIntake(t, token)
	put := `{"limit": 25, "reason": "partner asked", "by": "ops"}`
	for _, tok := range []string{"", "wrong"} {
		if code, _ := call(t, srv, "PUT", "/v1/limits/drain:q", tok, put); code != http.StatusUnauthorized {
			t.Errorf("PUT with token %q: %d, want 401", tok, code)
		}
	}
	if n := rdb.HLen(context.Background(), "sluice:{limits}:runtime").Val(); n != 0 {
		t.Fatalf("%d runtime limits after refused requests, want none", n)
	}

	for _, tc := range []struct{ body, field string }{
		{`{"limit": "many", "reason": "r"}`, "limit"},
		{`{"limit": -1, "reason": "r"}`, "limit"},
		{`{"limit": 5}`, "reason"},
		{`{"limit": 5, "period": "soon", "reason": "r"}`, "period"},
		{`{"limit": 5, "reason": "r", "colour": "red"}`, "colour"},
		{`{"limit": 5, "reason": "r", "key": "x"}`, "key"},
	} {
		code, answer := call(t, srv, "PUT", "/v1/limits/drain:q", token, tc.body)
		if code != http.StatusBadRequest || answer["field"] != tc.field {
			t.Errorf("PUT %s: %d %v, want 400 naming %q", tc.body, code, answer, tc.field)
		}
	}
	if code, answer := call(t, srv, "PUT", "/v1/limits/drain:nope", token, put); code != http.StatusBadRequest || !strings.Contains(fmt.Sprint(answer["error"]), "drain:q") {
		t.Errorf("PUT an unknown gate: %d %v, want 400 listing drain:q", code, answer)
	}

	if code, answer := call(t, srv, "PUT", "/v1/limits/drain:q", token, put); code != http.StatusOK {
		t.Fatalf("PUT: %d %v", code, answer)
	}
	code, answer := call(t, srv, "GET", "/v1/limits", token, "")
	gates, _ := answer["gates"].([]any)
	if code != http.StatusOK || len(gates) != 1 {
		t.Fatalf("GET /v1/limits: %d %v", code, answer)
	}
	g := gates[0].(map[string]any)
	if g["gate"] != "drain:q" || g["in_force"].(map[string]any)["limit"] != 25.0 || g["file"].(map[string]any)["limit"] != 5.0 {
		t.Errorf("GET /v1/limits: %v, want drain:q at 25 in force over the file's 5", g)
	}
	if code, answer := call(t, srv, "DELETE", "/v1/limits/drain:q?reason=done", token, ""); code != http.StatusOK || answer["reset"] != true {
		t.Errorf("DELETE: %d %v", code, answer)
	}
	producer := asynq.NewClient(asynq.RedisClientOpt{Addr: redistest.Addr(t), DB: 6})
	defer producer.Close()
	if _, err := producer.Enqueue(asynq.NewTask("demo:noop", nil), asynq.Queue("q"), asynq.TaskID("t1")); err != nil {
		t.Fatal(err)
	}
	code, answer = call(t, srv, "GET", "/v1/tasks/q/t1", token, "")
	if task, _ := answer["task"].(map[string]any); code != http.StatusOK || task["id"] != "t1" || task["state"] != "pending" || task["position"] != 1.0 {
		t.Errorf("GET /v1/tasks/q/t1: %d %v, want t1 pending at position 1", code, answer)
	}
	if code, answer := call(t, srv, "GET", "/v1/tasks/q/no-such-task", token, ""); code != http.StatusNotFound || !strings.Contains(fmt.Sprint(answer["error"]), "no-such-task") {
		t.Errorf("GET /v1/tasks/q/no-such-task: %d %v, want 404 naming it", code, answer)
	}
	code, answer = call(t, srv, "GET", "/v1/limits/history?gate=drain:q", token, "")
	events, _ := answer["events"].([]any)
	if code != http.StatusOK || len(events) != 2 || events[0].(map[string]any)["action"] != "reset" || events[1].(map[string]any)["by"] != "ops" {
		t.Errorf("history: %d %v, want the reset, then the set by ops", code, answer)
	}
}

// TestAdminTokenFailuresBan: wrong admin tokens count toward the intake's
// ban of the address: once banned, even the right token is refused.
func TestAdminTokenFailuresBan(t *testing.T) {
	const token = "admin-secret"
	srv, _ := adminIntake(t, token)
	for range 3 {
		call(t, srv, "GET", "/v1/limits", "guess", "")
	}
	if code, _ := call(t, srv, "GET", "/v1/limits", token, ""); code != http.StatusTooManyRequests {
		t.Errorf("the right token after 3 wrong ones: %d, want 429 (banned)", code)
	}
}

// TestAdminOff: with no admin token configured, the admin routes do not
// exist.
func TestAdminOff(t *testing.T) {
	srv, _ := adminIntake(t, "")
	for _, r := range [][2]string{{"GET", "/v1/limits"}, {"PUT", "/v1/limits/drain:q"}, {"DELETE", "/v1/limits/drain:q"}, {"GET", "/v1/limits/history"}, {"GET", "/v1/tasks/q/x"}} {
		if code, _ := call(t, srv, r[0], r[1], "anything", `{"limit": 1, "reason": "r"}`); code != http.StatusNotFound {
			t.Errorf("%s %s with no admin token configured: %d, want 404", r[0], r[1], code)
		}
	}
}
