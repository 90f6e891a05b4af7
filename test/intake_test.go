package test

import (
	"bufio"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/sluicehq/sluice/internal/redistest"
	"github.com/sluicehq/sluice/internal/testkit"
	"github.com/sluicehq/sluice/jobs"
)

// limitName gives a test's limits names of their own: the limits' state in
// Redis is keyed by name.
func limitName(t *testing.T, name string) string {
	return fmt.Sprintf("%s-%x", name, rand.Uint32())
}

func TestIntakeRetryAfter(t *testing.T) {
	t.Parallel()
	queue := redistest.Queue(t, "q")
	s := startIntake(t, fmt.Sprintf(`  limits:
    - {name: %s, key: client, algorithm: sliding_log, limit: 3, period: 2s}
`, limitName(t, "per-client")), queue)
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
	t.Parallel()
	queue := redistest.Queue(t, "q")
	s := startIntake(t, fmt.Sprintf(`  limits:
    - {name: %s, key: global, algorithm: token_bucket, limit: 10, period: 1m}
    - {name: %s, key: client, algorithm: sliding_log, limit: 3, period: 1m}
    - {name: %s, key: ip, algorithm: sliding_counter, limit: 10, period: 1m}
`, limitName(t, "overall"), limitName(t, "per-client"), limitName(t, "per-ip")), queue)
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
	t.Parallel()
	queue := redistest.Queue(t, "q")
	s := startIntake(t, fmt.Sprintf(`  limits:
    - {name: %s, key: ip, algorithm: sliding_log, limit: 50, period: 1m}
`, limitName(t, "per-ip")), queue)
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
	t.Parallel()
	queue := redistest.Queue(t, "q")
	s := startIntake(t, fmt.Sprintf(`  limits:
    - {name: %s, key: client, algorithm: sliding_log, limit: 2, period: 1s}
  ban: {after: 3, within: 1m, for: 2s, max: 8s}
`, limitName(t, "per-client")), queue)
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
	t.Parallel()
	queue := redistest.Queue(t, "q")
	s := startIntake(t, fmt.Sprintf(`  limits:
    - {name: %s, key: global, algorithm: token_bucket, limit: 1000, period: 1s, burst: 1000}
    - {name: %s, key: client, algorithm: sliding_log, limit: 5, period: 1m}
`, limitName(t, "overall"), limitName(t, "per-client")), queue)
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

// TestIntakeRefuses (9.9, 9.1): what no worker would run, or what the
// intake does not take, is 400 naming the field, and nothing is enqueued:
// a queue no config names, options.group (workers run no aggregator), and
// http:request, which gateway.types leaves out by default.
func TestIntakeRefuses(t *testing.T) {
	t.Parallel()
	queue, unknown := redistest.Queue(t, "q"), redistest.Queue(t, "nowhere")
	s := startIntake(t, "", queue)
	for _, c := range []struct{ desc, body, want string }{
		{"a queue no config names", fmt.Sprintf(`{"type": "demo:noop", "queue": %q}`, unknown), `queue: \"` + unknown + `\" is not under queues`},
		{"the default queue, not configured here", `{"type": "demo:noop"}`, `queue: \"default\" is not under queues`},
		{"a task id too long", fmt.Sprintf(`{"type": "demo:noop", "queue": %q, "options": {"task_id": %q}}`, queue, strings.Repeat("x", 1025)),
			"options.task_id: is 1025 bytes long; task ids are at most 1024 bytes"},
		{"a group", fmt.Sprintf(`{"type": "demo:noop", "queue": %q, "options": {"group": "g"}}`, queue), "options.group: workers run no group aggregator"},
		{"http:request by default", fmt.Sprintf(`{"type": "http:request", "queue": %q, "payload": {"url": "http://127.0.0.1:2112/ui/api/queues"}}`, queue),
			`type: \"http:request\" is not a type this intake takes (gateway.types: demo:noop, demo:sleep)`},
	} {
		status, body := s.send(t, c.body, nil)
		if status != http.StatusBadRequest || !strings.Contains(body, c.want) {
			t.Errorf("%s: %d %s, want 400 saying %s", c.desc, status, body, c.want)
		}
	}
	if n := queueSize(t, redistest.Addr(t), unknown); n != 0 {
		t.Errorf("%d tasks in the unknown queue, want 0", n)
	}
	if n := queueSize(t, redistest.Addr(t), queue); n != 0 {
		t.Errorf("%d tasks in the queue, want 0", n)
	}
	if status, body := s.send(t, fmt.Sprintf(`{"type": "demo:noop", "queue": %q}`, queue), nil); status != http.StatusAccepted {
		t.Errorf("a good request: %d %s, want 202", status, body)
	}
}

// trustLoopback is a gateway section that believes X-Forwarded-For from
// this machine, so that a test's requests can come from an address of
// their own (see clientAddr): bans on an address outlive a test in Redis.
const trustLoopback = "  trusted_proxies: [127.0.0.1/32]\n"

// clientAddr is an X-Forwarded-For header with an address of the test's
// own, from the documentation range 2001:db8::/32.
func clientAddr() map[string]string {
	return map[string]string{"X-Forwarded-For": fmt.Sprintf("2001:db8:%x:%x::1", rand.Uint32N(1<<16), rand.Uint32N(1<<16))}
}

// with returns headers plus the header k: v.
func with(headers map[string]string, k, v string) map[string]string {
	h := maps.Clone(headers)
	if h == nil {
		h = map[string]string{}
	}
	h[k] = v
	return h
}

// keyHash is the SHA-256 of key in hex, as gateway.clients wants it.
func keyHash(key string) string {
	sum := sha256.Sum256([]byte(key))
	return hex.EncodeToString(sum[:])
}

// TestIntakeClients (9.12): with gateway.clients, a request needs a known
// API key: none or an unknown one is 401 and counts toward a ban on the
// address; each client may use its types and queues only (403); the keys
// are never logged; a client added to the file is let in without a
// restart.
func TestIntakeClients(t *testing.T) {
	t.Parallel()
	q1, q2 := redistest.Queue(t, "q1"), redistest.Queue(t, "q2")
	gateway := trustLoopback + fmt.Sprintf(`  clients:
    - {name: alice, key_sha256: %s, types: [demo:noop], queues: [%s]}
    - {name: bob, key_sha256: %s}
  ban: {after: 4, within: 1m, for: 3s}
`, keyHash("alice-secret"), q1, strings.ToUpper(keyHash("bob-secret")))
	s := startIntake(t, gateway, q1, q2)
	noop := func(q string) string { return fmt.Sprintf(`{"type": "demo:noop", "queue": %q}`, q) }
	from := clientAddr()
	key := func(k string) map[string]string { return with(from, "X-API-Key", k) }
	for _, c := range []struct {
		desc    string
		body    string
		headers map[string]string
		status  int
		want    string
	}{
		{"alice in her queue", noop(q1), key("alice-secret"), http.StatusAccepted, `"id"`},
		{"bob anywhere", noop(q2), key("bob-secret"), http.StatusAccepted, `"id"`},
		{"bob with demo:sleep", fmt.Sprintf(`{"type": "demo:sleep", "queue": %q, "payload": {"ms": 1}}`, q2), key("bob-secret"), http.StatusAccepted, `"id"`},
		{"alice in another queue", noop(q2), key("alice-secret"), http.StatusForbidden, `queue: client \"alice\" may not enqueue to`},
		{"alice with another type", fmt.Sprintf(`{"type": "demo:sleep", "queue": %q, "payload": {"ms": 1}}`, q1), key("alice-secret"), http.StatusForbidden, `type: client \"alice\" may not enqueue \"demo:sleep\"`},
		{"no key", noop(q1), from, http.StatusUnauthorized, "an API key is required"},
		{"an unknown key", noop(q1), key("alice-secreT"), http.StatusUnauthorized, "unknown API key"},
	} {
		status, body := s.send(t, c.body, c.headers)
		if status != c.status || !strings.Contains(body, c.want) {
			t.Errorf("%s: %d %s, want %d saying %s", c.desc, status, body, c.status, c.want)
		}
	}
	// Two refusals so far; two more unknown keys from this address ban it,
	// a known key included.
	for range 2 {
		s.send(t, noop(q1), key("guess"))
	}
	if status, body := s.send(t, noop(q1), key("alice-secret")); status != http.StatusTooManyRequests {
		t.Errorf("after 4 refused keys: %d %s, want 429 (the address is banned)", status, body)
	}
	if status, body := s.send(t, noop(q1), with(clientAddr(), "X-API-Key", "alice-secret")); status != http.StatusAccepted {
		t.Errorf("alice from another address: %d %s, want 202", status, body)
	}
	from = clientAddr()

	b, err := os.ReadFile(s.config)
	if err != nil {
		t.Fatal(err)
	}
	added := strings.Replace(string(b), "  ban:", fmt.Sprintf("    - {name: carol, key_sha256: %s}\n  ban:", keyHash("carol-secret")), 1)
	if err := os.WriteFile(s.config, []byte(added), 0o644); err != nil {
		t.Fatal(err)
	}
	testkit.WaitFor(t, 5*time.Second, "carol's key to be taken after the config changed", func() bool {
		status, _ := s.send(t, noop(q2), key("carol-secret"))
		return status == http.StatusAccepted
	})
	log, _ := os.ReadFile(s.log)
	for _, secret := range []string{"alice-secret", "bob-secret", "carol-secret", "guess", keyHash("alice-secret")} {
		if strings.Contains(string(log), secret) {
			t.Errorf("the intake's log holds %q", secret)
		}
	}
}

// TestIntakeNamesClient (issue 19.10): every task the intake takes carries
// its client's name, from its API key, in the header that key expressions
// read as client (jobs.HeaderClient); a request cannot name another
// client: a Sluice-Client request header changes nothing.
func TestIntakeNamesClient(t *testing.T) {
	t.Parallel()
	queue := redistest.Queue(t, "q")
	s := startIntake(t, trustLoopback+fmt.Sprintf(`  clients:
    - {name: alice, key_sha256: %s}
    - {name: bob, key_sha256: %s}
`, keyHash("alice-secret"), keyHash("bob-secret")), queue)
	inspector := asynq.NewInspector(asynq.RedisClientOpt{Addr: redistest.Addr(t)})
	defer inspector.Close()
	for _, c := range []struct{ key, want string }{{"alice-secret", "alice"}, {"bob-secret", "bob"}} {
		headers := with(with(clientAddr(), "X-API-Key", c.key), jobs.HeaderClient, "mallory")
		status, body := s.send(t, fmt.Sprintf(`{"type": "demo:noop", "queue": %q}`, queue), headers)
		var answer struct{ ID string }
		if err := json.Unmarshal([]byte(body), &answer); status != http.StatusAccepted || err != nil {
			t.Fatalf("%s: %d %s, want 202", c.want, status, body)
		}
		info, err := inspector.GetTaskInfo(queue, answer.ID)
		if err != nil {
			t.Fatal(err)
		}
		if got := info.Headers[jobs.HeaderClient]; got != c.want {
			t.Errorf("the task %s enqueued has %s %q, want %q", c.want, jobs.HeaderClient, got, c.want)
		}
	}
}

// TestIntakePublicNeedsClients (9.12): an intake configured to listen
// beyond loopback without API keys does not start (exit 2, naming
// gateway.listen and gateway.clients), unless anonymous clients are
// allowed on purpose.
func TestIntakePublicNeedsClients(t *testing.T) {
	t.Parallel()
	_, port, _ := strings.Cut(testkit.FreeAddr(t), ":")
	config := writeConfig(t, fmt.Sprintf("redis: {addr: %s}\ngateway: {listen: '0.0.0.0:%s', metrics_addr: %s}\n", redistest.Addr(t), port, testkit.FreeAddr(t)))
	r := runEnqueue(t, redistest.Addr(t), nil, "--config", config, "serve")
	if r.code != 2 || !strings.Contains(r.stderr, "gateway.listen 0.0.0.0:"+port) || !strings.Contains(r.stderr, "gateway.clients") ||
		!strings.Contains(r.stderr, "gateway.allow_anonymous") {
		t.Errorf("want exit 2 naming gateway.listen, gateway.clients and gateway.allow_anonymous\n%v", r)
	}
	s := startIntake(t, "  allow_anonymous: true\n", redistest.Queue(t, "q"))
	if resp, err := http.Get(s.url + "/healthz"); err != nil {
		t.Errorf("with allow_anonymous: %v", err)
	} else {
		resp.Body.Close()
	}
}

// TestIntakeCheapChecksFirst (suspected in 9): a banned client, or one
// without a known key, is answered before its body is read: a request
// whose body never comes gets its 429 or 401 at once, where the intake
// used to wait for the body (30 s) first.
func TestIntakeCheapChecksFirst(t *testing.T) {
	t.Parallel()
	queue := redistest.Queue(t, "q")
	s := startIntake(t, trustLoopback+fmt.Sprintf(`  limits:
    - {name: %s, key: client, algorithm: sliding_log, limit: 1, period: 1m}
  ban: {after: 2, within: 1m, for: 1m}
  clients:
    - {name: mallory, key_sha256: %s}
`, limitName(t, "per-client"), keyHash("mallory-key")), queue)
	from := clientAddr()
	for range 3 { // one accepted, two refused: banned
		s.send(t, fmt.Sprintf(`{"type": "demo:noop", "queue": %q}`, queue), with(from, "X-API-Key", "mallory-key"))
	}
	for _, c := range []struct {
		desc, key string
		status    int
	}{
		{"banned", "mallory-key", http.StatusTooManyRequests},
		{"unknown key", "nobody", http.StatusUnauthorized},
	} {
		host := strings.TrimPrefix(s.url, "http://")
		conn, err := net.Dial("tcp", host)
		if err != nil {
			t.Fatal(err)
		}
		// Headers promising a body that is never sent.
		fmt.Fprintf(conn, "POST /v1/tasks HTTP/1.1\r\nHost: %s\r\nX-API-Key: %s\r\nX-Forwarded-For: %s\r\nContent-Length: 1000\r\n\r\n",
			host, c.key, from["X-Forwarded-For"])
		conn.SetReadDeadline(time.Now().Add(2 * time.Second))
		resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
		if err != nil {
			t.Errorf("%s: no answer within 2 s while the body is missing: %v", c.desc, err)
		} else if resp.StatusCode != c.status {
			t.Errorf("%s: %d, want %d", c.desc, resp.StatusCode, c.status)
		}
		conn.Close()
	}
}

// TestIntakeConnectionsAndMetrics (suspected in 9): the intake holds at
// most gateway.max_connections connections at once, and serves /metrics
// only on gateway.metrics_addr, not on its public listener.
func TestIntakeConnectionsAndMetrics(t *testing.T) {
	t.Parallel()
	s := startIntake(t, "  max_connections: 3\n", redistest.Queue(t, "q"))
	s.send(t, `{"type": "demo:noop", "queue": "nowhere"}`, nil) // a 400, so the counter has a sample
	if resp, err := http.Get(s.url + "/metrics"); err != nil {
		t.Fatal(err)
	} else if resp.Body.Close(); resp.StatusCode != http.StatusNotFound {
		t.Errorf("/metrics on the public listener: %s, want 404", resp.Status)
	}
	resp, err := http.Get(s.metrics + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || !strings.Contains(string(b), "sluice_intake_requests_total") {
		t.Errorf("/metrics on gateway.metrics_addr: %d, want 200 with sluice_intake_requests_total", resp.StatusCode)
	}

	http.DefaultClient.CloseIdleConnections() // kept-alive connections would hold slots
	host := strings.TrimPrefix(s.url, "http://")
	var idle []net.Conn
	for range 3 {
		conn, err := net.Dial("tcp", host)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		idle = append(idle, conn)
	}
	time.Sleep(100 * time.Millisecond) // accepted, each waiting for its request line
	quick := &http.Client{Timeout: time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	if resp, err := quick.Get(s.url + "/healthz"); err == nil {
		resp.Body.Close()
		t.Fatalf("a 4th connection was served while 3 were open (max_connections: 3)")
	}
	idle[0].Close()
	if resp, err := quick.Get(s.url + "/healthz"); err != nil {
		t.Errorf("after one connection closed: %v, want an answer", err)
	} else {
		resp.Body.Close()
	}
}

// TestIntakeRevokedKeys (19.2): the start-time rule holds after every live
// reload of an intake off loopback. A revoked key is refused (401) by the
// first request after the reload is in force; with its last client revoked,
// the intake refuses every request, with the revoked key, another or none,
// 503 saying it has no clients configured, and says so in its log; a client
// configured again is let in. On main, the reload to no clients logged
// "config change in force clients=0" and let every request in (202).
func TestIntakeRevokedKeys(t *testing.T) {
	t.Parallel()
	queue := redistest.Queue(t, "q")
	client := func(name string) string {
		return fmt.Sprintf("{name: %s, key_sha256: %s}", name, keyHash(name+"-secret"))
	}
	_, port, _ := net.SplitHostPort(testkit.FreeAddr(t))
	s := startIntakeOn(t, "0.0.0.0:"+port, fmt.Sprintf("  clients: [%s, %s]\n", client("alice"), client("bob")), queue)
	reloads := 0
	reload := func(clients ...string) {
		t.Helper()
		b, err := os.ReadFile(s.config)
		if err != nil {
			t.Fatal(err)
		}
		i := strings.Index(string(b), "  clients: ")
		changed := string(b[:i]) + "  clients: [" + strings.Join(clients, ", ") + "]\n"
		if err := os.WriteFile(s.config, []byte(changed), 0o644); err != nil {
			t.Fatal(err)
		}
		reloads++
		testkit.WaitFor(t, 10*time.Second, "the config change to be in force", func() bool {
			log, _ := os.ReadFile(s.log)
			return strings.Count(string(log), "config change in force") == reloads
		})
	}
	noop := fmt.Sprintf(`{"type": "demo:noop", "queue": %q}`, queue)
	check := func(desc, key string, want int, saying string) {
		t.Helper()
		headers := map[string]string{}
		if key != "" {
			headers["X-API-Key"] = key
		}
		if status, body := s.send(t, noop, headers); status != want || !strings.Contains(body, saying) {
			t.Errorf("%s: %d %s, want %d saying %q", desc, status, body, want, saying)
		}
	}
	check("alice before any change", "alice-secret", http.StatusAccepted, `"id"`)

	reload(client("bob"))
	check("alice's revoked key", "alice-secret", http.StatusUnauthorized, "unknown API key")
	check("bob's key", "bob-secret", http.StatusAccepted, `"id"`)

	reload()
	const closed = "no clients configured"
	check("bob's revoked key, with no clients left", "bob-secret", http.StatusServiceUnavailable, closed)
	check("no key, with no clients left", "", http.StatusServiceUnavailable, closed)
	check("a made-up key, with no clients left", "guess", http.StatusServiceUnavailable, closed)
	if log, _ := os.ReadFile(s.log); !strings.Contains(string(log), "the intake has no clients configured and refuses every request") {
		t.Errorf("the log does not say that the intake refuses every request:\n%s", tail(string(log), 5))
	}

	reload(client("carol"))
	check("carol, configured after", "carol-secret", http.StatusAccepted, `"id"`)
	check("no key, with carol configured", "", http.StatusUnauthorized, "an API key is required")
	if n := queueSize(t, redistest.Addr(t), queue); n != 3 {
		t.Errorf("%d tasks in the queue, want the 3 answered 202", n)
	}
}
