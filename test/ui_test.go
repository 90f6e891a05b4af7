package test

import (
	"fmt"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"golang.org/x/crypto/bcrypt"

	"github.com/sluicehq/sluice/internal/redistest"
	"github.com/sluicehq/sluice/internal/testkit"
)

// scheduleTasks puts n demo:noop tasks an hour ahead into queue.
func scheduleTasks(t *testing.T, queue string, n int) {
	t.Helper()
	client := asynq.NewClient(asynq.RedisClientOpt{Addr: redistest.Addr(t)})
	defer client.Close()
	for range n {
		if _, err := client.Enqueue(asynq.NewTask("demo:noop", nil), asynq.Queue(queue), asynq.ProcessIn(time.Hour)); err != nil {
			t.Fatal(err)
		}
	}
}

// scheduled is how many tasks of queue wait for their time.
func scheduled(t *testing.T, queue string) int {
	t.Helper()
	inspector := asynq.NewInspector(asynq.RedisClientOpt{Addr: redistest.Addr(t)})
	defer inspector.Close()
	info, err := inspector.GetQueueInfo(queue)
	if err != nil {
		t.Fatal(err)
	}
	return info.Scheduled
}

// uiRequest makes one request to a worker's web UI, with basic auth if
// user is not "", and returns the status.
func uiRequest(t *testing.T, w *worker, method, path, user, password string) int {
	t.Helper()
	req, _ := http.NewRequest(method, "http://"+w.metrics+path, nil)
	if user != "" {
		req.SetBasicAuth(user, password)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	return resp.StatusCode
}

// TestWebUIReadOnly (9.1): by default the worker's web UI shows the queues
// and the limits page but changes nothing: every write of asynqmon's API
// is 405, as is any but GET on the limits page, and the scheduled tasks
// stay.
func TestWebUIReadOnly(t *testing.T) {
	t.Parallel()
	queue := redistest.Queue(t, "reports")
	w := startWorker(t, writeConfig(t, fmt.Sprintf("redis: {addr: %s}\nqueues: {%s: {}}\n", redistest.Addr(t), queue)))
	scheduleTasks(t, queue, 5)
	for _, c := range []struct{ method, path string }{
		{"DELETE", "/ui/api/queues/" + queue + "/scheduled_tasks:delete_all"},
		{"POST", "/ui/api/queues/" + queue + "/scheduled_tasks:run_all"},
		{"POST", "/ui/api/queues/" + queue + ":pause"},
		{"DELETE", "/ui/api/queues/" + queue + "?force=true"},
		{"PUT", "/ui/api/queues/" + queue},
		{"POST", "/ui/limits"},
		{"DELETE", "/ui/limits.json"},
	} {
		if status := uiRequest(t, w, c.method, c.path, "", ""); status != http.StatusMethodNotAllowed {
			t.Errorf("%s %s: %d, want 405", c.method, c.path, status)
		}
	}
	for _, path := range []string{"/ui/api/queues/" + queue, "/ui/limits", "/ui/limits.json", "/ui/limits/static/limits.js"} {
		if status := uiRequest(t, w, "GET", path, "", ""); status != http.StatusOK {
			t.Errorf("GET %s: %d, want 200", path, status)
		}
	}
	if n := scheduled(t, queue); n != 5 {
		t.Errorf("%d scheduled tasks left, want 5", n)
	}
}

// TestWebUIWrites (9.1): with worker.ui.writes, every page (the limits page
// too) needs the login
// (compared with a bcrypt hash), and with it a user may delete; neither
// the password nor its hash is logged.
func TestWebUIWrites(t *testing.T) {
	t.Parallel()
	queue := redistest.Queue(t, "reports")
	hash, err := bcrypt.GenerateFromPassword([]byte("correct horse"), bcrypt.MinCost)
	if err != nil {
		t.Fatal(err)
	}
	w := startWorker(t, writeConfig(t, fmt.Sprintf("redis: {addr: %s}\nqueues: {%s: {}}\nworker: {ui: {writes: true, user: admin}}\n", redistest.Addr(t), queue)),
		"SLUICE_WORKER_UI_PASSWORD_HASH="+string(hash))
	scheduleTasks(t, queue, 5)
	deleteAll := "/ui/api/queues/" + queue + "/scheduled_tasks:delete_all"
	for _, c := range []struct {
		desc, method, path, user, password string
		status                             int
	}{
		{"read without a login", "GET", "/ui/api/queues", "", "", http.StatusUnauthorized},
		{"the limits page without a login", "GET", "/ui/limits", "", "", http.StatusUnauthorized},
		{"the limits page's figures without a login", "GET", "/ui/limits.json", "", "", http.StatusUnauthorized},
		{"the limits page with the login", "GET", "/ui/limits", "admin", "correct horse", http.StatusOK},
		{"delete without a login", "DELETE", deleteAll, "", "", http.StatusUnauthorized},
		{"delete with a wrong password", "DELETE", deleteAll, "admin", "wrong horse", http.StatusUnauthorized},
		{"delete as another user", "DELETE", deleteAll, "root", "correct horse", http.StatusUnauthorized},
		{"read with the login", "GET", "/ui/api/queues", "admin", "correct horse", http.StatusOK},
	} {
		if status := uiRequest(t, w, c.method, c.path, c.user, c.password); status != c.status {
			t.Errorf("%s: %d, want %d", c.desc, status, c.status)
		}
	}
	if n := scheduled(t, queue); n != 5 {
		t.Fatalf("%d scheduled tasks left after refused deletes, want 5", n)
	}
	if status := uiRequest(t, w, "DELETE", deleteAll, "admin", "correct horse"); status != http.StatusOK {
		t.Errorf("delete with the login: %d, want 200", status)
	}
	if n := scheduled(t, queue); n != 0 {
		t.Errorf("%d scheduled tasks left after the delete, want 0", n)
	}
	if status := uiRequest(t, w, "GET", "/metrics", "", ""); status != http.StatusOK {
		t.Errorf("/metrics without a login: %d, want 200 (Prometheus scrapes it)", status)
	}
	log, _ := os.ReadFile(w.log)
	if strings.Contains(string(log), "correct horse") || strings.Contains(string(log), string(hash)) {
		t.Error("the worker's log holds the password or its hash")
	}
}

// TestIntakeCannotReachWorkerUI (9.1): the review's attack, end to end. An
// intake that takes http:request, and a worker with the default http.allow
// [127.0.0.1, localhost]: a task asking the worker to delete its own queue's
// scheduled tasks through the UI is refused (port 2112 is not listed) and
// archived at once with a message saying why, and the tasks stay.
func TestIntakeCannotReachWorkerUI(t *testing.T) {
	t.Parallel()
	queue := redistest.Queue(t, "reports")
	w := startWorker(t, writeConfig(t, fmt.Sprintf("redis: {addr: %s}\nqueues: {%s: {}}\nhttp: {allow: [127.0.0.1, localhost]}\n", redistest.Addr(t), queue)))
	scheduleTasks(t, queue, 5)
	s := startIntake(t, "  types: [demo:noop, http:request]\n", queue)
	body := fmt.Sprintf(`{"type": "http:request", "queue": %q, "options": {"max_retry": 3}, "payload": {"method": "DELETE", "url": "http://%s/ui/api/queues/%s/scheduled_tasks:delete_all"}}`,
		queue, w.metrics, queue)
	status, answer := s.send(t, body, nil)
	if status != http.StatusAccepted {
		t.Fatalf("the intake answered %d %s, want 202 (http:request is in gateway.types here)", status, answer)
	}
	inspector := asynq.NewInspector(asynq.RedisClientOpt{Addr: redistest.Addr(t)})
	defer inspector.Close()
	var archived *asynq.TaskInfo
	testkit.WaitFor(t, 15*time.Second, "the task to be archived", func() bool {
		tasks, err := inspector.ListArchivedTasks(queue)
		if err == nil && len(tasks) == 1 {
			archived = tasks[0]
		}
		return archived != nil
	})
	if want := fmt.Sprintf("address 127.0.0.1 port %s is not in http.allow", strings.Split(w.metrics, ":")[1]); !strings.Contains(archived.LastErr, want) || archived.Retried != 0 {
		t.Errorf("archived after %d retries with %q; want none and an error saying %q", archived.Retried, archived.LastErr, want)
	}
	if n := scheduled(t, queue); n != 5 {
		t.Errorf("%d scheduled tasks left, want 5", n)
	}
}
