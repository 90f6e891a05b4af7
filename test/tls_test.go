package test

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/config"
	"github.com/sluicehq/sluice/internal/redistest"
	"github.com/sluicehq/sluice/internal/testkit"
)

// tlsServerName is the only name in the test server's certificate: the
// workers connect to 127.0.0.1 and must be told it, as with a managed
// Redis whose certificate names another host.
const tlsServerName = "redis.sluice.test"

// TestTLSAndACL: a worker and enqueue against a redis-server that serves
// TLS only, with a CA made by the test, asking for client certificates,
// logged in as an ACL user that has exactly what docs/security.md lists: 20
// http:request tasks of 2 tenants from `enqueue --file` (half with
// MaxRetry 0) run once each through a drained queue (10/s: never more than
// 11 in a second) with fair shares by tenant and a quota keyed by tenant
// (4/s burst 4, so tasks wait and some wait in their tenant's line),
// `enqueue status` answers, with --keys for the keyed quota and the fair
// share, and Redis refused no command, key or channel
// (ACL LOG, no Redis error counted). A wrong CA or a wrong password stops worker
// and enqueue with exit code 1 and one line that names the key.
func TestTLSAndACL(t *testing.T) {
	t.Parallel()
	ca, otherCA := testkit.NewCA(t), testkit.NewCA(t)
	later := time.Now().Add(time.Hour)
	serverCert, serverKey := ca.Issue(t, "server", []string{tlsServerName}, later)
	clientCert, clientKey := ca.Issue(t, "client", nil, later)
	admin := config.Redis{TLS: true, TLSCaFile: ca.CertFile, TLSCertFile: clientCert, TLSKeyFile: clientKey, TLSServerName: tlsServerName}
	srv := redistest.StartTLSServer(t, admin.TLSConfig(),
		"--tls-cert-file", serverCert, "--tls-key-file", serverKey, "--tls-ca-cert-file", ca.CertFile, "--tls-auth-clients", "yes")
	admin.Addr = srv.Addr
	rdb := admin.Client()
	defer rdb.Close()
	const password = "tls-and-acl"
	if err := rdb.Do(context.Background(), documentedACL(t, password)...).Err(); err != nil {
		t.Fatalf("the documented ACL: %v", err)
	}

	u := newUpstream(t)
	queue := redistest.Queue(t, "q")
	redisYAML := func(caFile, password string) string {
		return fmt.Sprintf(`redis:
  addr: %s
  username: sluice
  password: %s
  tls: true
  tls_ca_file: %s
  tls_cert_file: %s
  tls_key_file: %s
  tls_server_name: %s
`, srv.Addr, password, caFile, clientCert, clientKey, tlsServerName)
	}
	rest := fmt.Sprintf(`worker: {concurrency: 10}
queues:
  %s:
    drain: {algorithm: leaky_bucket, limit: 10, period: 1s, burst: 1}
    fairness: {key: 'payload.headers["X-Tenant"]'}
quotas:
  per-tenant: {algorithm: token_bucket, limit: 4, period: 1s, burst: 4, key: 'payload.headers["X-Tenant"]'}
tasks:
  http:request: {quotas: [per-tenant]}
`, queue) + u.allowYAML()
	good := writeConfig(t, redisYAML(ca.CertFile, password)+rest)

	t.Run("refused", func(t *testing.T) {
		for _, c := range []struct{ desc, config, key string }{
			{"another CA", writeConfig(t, redisYAML(otherCA.CertFile, password)+rest), "redis.tls_ca_file: the certificate of Redis at " + srv.Addr + " is not signed by a CA in " + otherCA.CertFile},
			{"wrong password", writeConfig(t, redisYAML(ca.CertFile, "wrong")+rest), `redis.password: Redis at ` + srv.Addr + ` refused the login of user "sluice": the password is wrong`},
		} {
			t.Run(c.desc, func(t *testing.T) {
				for _, args := range [][]string{{"worker", "--config", c.config}, {"enqueue", "--config", c.config, "--queue", queue, "demo:noop"}} {
					code, stderr := runToEnd(t, args...)
					lines := strings.Split(strings.TrimSpace(stderr), "\n")
					if code != 1 || len(lines) != 1 || !strings.HasPrefix(lines[0], args[0]+": "+c.key) {
						t.Errorf("%s: exit %d, stderr:\n%s\nwant exit 1 and one line %q...", args[0], code, stderr, args[0]+": "+c.key)
					}
				}
			})
		}
	})

	w := startWorker(t, good)
	const tasks = 20
	var lines strings.Builder
	for i := range tasks {
		fmt.Fprintf(&lines, `{"type": "http:request", "queue": %q, "payload": {"url": "%s/r/%d", "headers": {"X-Tenant": "t%d"}}, "options": {"max_retry": %d}}`+"\n", queue, u.URL, i, i%2, 3*(i%2))
	}
	if run := runEnqueue(t, srv.Addr, nil, "--config", good, "--file", writeFile(t, "tasks.jsonl", lines.String())); run.code != 0 {
		t.Fatalf("enqueue --file: %v", run)
	}
	testkit.WaitFor(t, 20*time.Second, fmt.Sprintf("%d requests", tasks), func() bool { return len(u.All()) >= tasks })
	time.Sleep(300 * time.Millisecond) // let any duplicate show itself
	arrivals := u.All()
	most := testkit.MaxInWindow(arrivals, time.Second-within)
	t.Logf("%d requests for %d tasks at %.2f/s, at most %d in a second", len(arrivals), u.Distinct(), rate(arrivals), most)
	if len(arrivals) != tasks || u.Distinct() != tasks {
		t.Errorf("%d requests for %d distinct tasks, want %d of %d", len(arrivals), u.Distinct(), tasks, tasks)
	}
	if most > 11 {
		t.Errorf("%d requests within one second through a drain of 10/s", most)
	}
	if run := runEnqueue(t, srv.Addr, nil, "--config", good, "status"); run.code != 0 || !strings.Contains(run.stdout, queue) {
		t.Errorf("enqueue status: %v", run)
	}
	for _, gate := range []string{"quota:per-tenant", "fair:" + queue} {
		if run := runEnqueue(t, srv.Addr, nil, "--config", good, "status", "--keys", gate); run.code != 0 || !strings.Contains(run.stdout, "KEYS OF "+gate) {
			t.Errorf("enqueue status --keys %s: %v", gate, run)
		}
	}
	if n := w.counter(t, "sluice_throttled_tasks_total"); n == 0 {
		t.Errorf("no task waited: the keyed quota and the fair share were not exercised")
	}
	if n := w.counter(t, "sluice_redis_errors_total"); n != 0 {
		t.Errorf("sluice_redis_errors_total is %v, want 0", n)
	}
	if n := w.counter(t, "sluice_tasks_processed_total", `result="error"`); n != 0 {
		t.Errorf("%v handler runs failed, want 0", n)
	}
	inspector := asynq.NewInspector(admin.AsynqOpt())
	defer inspector.Close()
	if info, err := inspector.GetQueueInfo(queue); err != nil || info.Archived+info.Retry+info.Pending+info.Scheduled+info.Active != 0 {
		t.Errorf("queue after the run: %+v, %v; want nothing left", info, err)
	}
	checkACLLog(t, rdb)
}

// checkACLLog fails the test if the ACL LOG of rdb's server holds a
// command, key or channel refused (a wrong password, reason "auth", is
// not one).
func checkACLLog(t *testing.T, rdb redis.UniversalClient) {
	t.Helper()
	entries, err := rdb.Do(context.Background(), "ACL", "LOG").Slice()
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		if entry, _ := e.(map[any]any); entry["reason"] != "auth" {
			t.Errorf("ACL LOG: %v; want no command, key or channel refused to the documented user", e)
		}
	}
}

// documentedACL is the ACL SETUSER for the sluice user that
// docs/security.md gives, as a command for go-redis, with password in
// place of CHANGE-ME: the test applies what the docs say, not a copy of it.
func documentedACL(t *testing.T, password string) []any {
	t.Helper()
	doc := []byte(readDoc(t, "docs/security.md"))
	_, block, ok := bytes.Cut(doc, []byte("redis-cli ACL SETUSER sluice "))
	if !ok {
		t.Fatal("docs/security.md has no `redis-cli ACL SETUSER sluice` block")
	}
	var cmd []any
	for _, line := range strings.Split(string(block), "\n") {
		more := strings.HasSuffix(line, `\`)
		for _, word := range strings.Fields(strings.TrimSuffix(line, `\`)) {
			cmd = append(cmd, strings.ReplaceAll(strings.Trim(word, "'"), "CHANGE-ME", password))
		}
		if !more {
			break
		}
	}
	if len(cmd) < 2 || cmd[0] != "reset" {
		t.Fatalf("the documented ACL starts %v, want reset: it must grant what it lists and nothing more", cmd)
	}
	return append([]any{"ACL", "SETUSER", "sluice"}, cmd...)
}

// runToEnd runs a binary of bin with args (its --config names a config
// whose Redis refuses it) and returns its exit code and stderr; it fails
// the test if the binary is still running after 20 s.
func runToEnd(t *testing.T, args ...string) (code int, stderr string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, filepath.Join(bin, args[0]), args[1:]...)
	cmd.Env = append(os.Environ(), "SLUICE_WORKER_METRICS_ADDR="+testkit.FreeAddr(t))
	var out bytes.Buffer
	cmd.Stderr = &out
	cmd.Run()
	if ctx.Err() != nil {
		t.Fatalf("%s still running after 20 s; stderr:\n%s", args[0], tail(out.String(), 20))
	}
	return cmd.ProcessState.ExitCode(), out.String()
}
