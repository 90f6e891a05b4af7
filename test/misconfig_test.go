package test

import (
	"fmt"
	"net/http"
	"strings"
	"testing"

	"github.com/sluicehq/sluice/internal/redistest"
)

// TestEnqueueRefusesKeyErrors: a payload whose key cannot be computed for
// a keyed quota (the producer wrote tokn for token) is refused before
// anything is written, with the limit, the expression and the problem
// named: enqueue exits 2 (bad input); --file refuses the whole file naming
// the line (nothing enqueued, as for any bad line); the intake answers
// 400. A payload with its key is taken.
func TestEnqueueRefusesKeyErrors(t *testing.T) {
	t.Parallel()
	addr := redistest.Addr(t)
	queue, quota := redistest.Queue(t, "crm"), redistest.Queue(t, "crm-api")
	limits := fmt.Sprintf(`quotas:
  %s: {limit: 5, period: 1s, key: payload.token, on_key_error: wait}
tasks:
  crm:sync: {quotas: [%s]}
`, quota, quota)
	config := writeConfig(t, fmt.Sprintf("redis: {addr: 127.0.0.1:1}\nqueues:\n  %s: {}\n%s", queue, limits))
	want := fmt.Sprintf(`the key of quotas.%s.key (payload.token) cannot be computed for this task: no such key: token; a worker would hold it until its key can be computed (on_key_error: wait)`, quota)

	r := runEnqueue(t, addr, nil, "--config", config, "--queue", queue, "crm:sync", `{"tokn": "t-1"}`)
	if r.code != 2 || !strings.Contains(r.stderr, want) {
		t.Errorf("enqueue a payload without its key: want exit 2 and %q\n%v", want, r)
	}
	t.Logf("enqueue: exit %d: %s", r.code, r.stderr)
	path := writeLines(t, 3, func(i int) string {
		if i == 2 {
			return `{"type": "crm:sync", "payload": {"tokn": "t-2"}}`
		}
		return fmt.Sprintf(`{"type": "crm:sync", "payload": {"token": "t-%d"}}`, i)
	})
	r = runEnqueue(t, addr, nil, "--config", config, "--queue", queue, "--file", path)
	if r.code != 2 || !strings.Contains(r.stderr, "line 2: "+want) {
		t.Errorf("enqueue --file with a payload without its key on line 2: want exit 2 and %q\n%v", "line 2: "+want, r)
	}
	if n := queueSize(t, addr, queue); n != 0 {
		t.Errorf("%d tasks enqueued after refusals, want 0", n)
	}
	if r := runEnqueue(t, addr, nil, "--config", config, "--queue", queue, "crm:sync", `{"token": "t-1"}`); r.code != 0 {
		t.Errorf("enqueue a payload with its key: want exit 0\n%v", r)
	}

	// The intake's config has its gateway section last: limits go after it.
	s := startIntake(t, "  types: [crm:sync]\n"+limits, queue)
	status, body := s.send(t, fmt.Sprintf(`{"type": "crm:sync", "queue": %q, "payload": {"tokn": "t-3"}}`, queue), nil)
	if status != http.StatusBadRequest || !strings.Contains(body, strings.ReplaceAll(want, `"`, `\"`)) {
		t.Errorf("intake, a payload without its key: %d %s, want 400 and %q", status, body, want)
	}
	t.Logf("intake: %d %s", status, body)
	if status, body := s.send(t, fmt.Sprintf(`{"type": "crm:sync", "queue": %q, "payload": {"token": "t-3"}}`, queue), nil); status != http.StatusAccepted {
		t.Errorf("intake, a payload with its key: %d %s, want 202", status, body)
	}
}
