// Package redistest connects tests to the real Redis servers that
// `make test` (scripts/redis-env.sh) starts for the run: a standalone
// redis-server and a 3-master Redis Cluster; and starts servers of a
// test's own (StartServer, StartTLSServer, StartCluster) from the
// redis-server binary it names.
package redistest

import (
	"context"
	"crypto/rand"
	"crypto/tls"
	"encoding/hex"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/internal/testkit"
)

func env(tb testing.TB, name string) string {
	tb.Helper()
	v := os.Getenv(name)
	if v == "" {
		tb.Fatalf("%s is not set: run the tests with `make test`, which starts redis-server and sets it", name)
	}
	return v
}

// Addr is the standalone server's address.
func Addr(tb testing.TB) string { return env(tb, "SLUICE_TEST_REDIS_ADDR") }

// Client connects to the standalone server, with go-redis's default
// options as most callers use them (retries included: the limiters never
// let go-redis send their calls twice), and closes the client when the
// test ends.
func Client(tb testing.TB) *redis.Client {
	tb.Helper()
	rdb := redis.NewClient(&redis.Options{Addr: Addr(tb)})
	ping(tb, rdb)
	return rdb
}

// ClusterAddrs are the cluster's three masters.
func ClusterAddrs(tb testing.TB) []string {
	return strings.Split(env(tb, "SLUICE_TEST_REDIS_CLUSTER"), ",")
}

// Cluster connects to the 3-master cluster and closes the client when the
// test ends.
func Cluster(tb testing.TB) *redis.ClusterClient {
	tb.Helper()
	rdb := redis.NewClusterClient(&redis.ClusterOptions{Addrs: ClusterAddrs(tb)})
	ping(tb, rdb)
	return rdb
}

func ping(tb testing.TB, rdb redis.UniversalClient) {
	tb.Helper()
	tb.Cleanup(func() { rdb.Close() })
	if err := rdb.Ping(context.Background()).Err(); err != nil {
		tb.Fatalf("redis is not answering: %v", err)
	}
}

// Prefix returns a key prefix of its own for one test, so that tests in
// parallel packages share the servers without flushing each other's data.
func Prefix(tb testing.TB) string {
	name := strings.NewReplacer("{", "(", "}", ")", " ", "_").Replace(tb.Name())
	return "test:" + name + ":" + randomHex(tb) + ":"
}

// randomHex is 12 random hex digits.
func randomHex(tb testing.TB) string {
	var b [6]byte
	if _, err := rand.Read(b[:]); err != nil {
		tb.Fatal(err)
	}
	return hex.EncodeToString(b[:])
}

// Queue returns an asynq queue name of the test's own (lower case, as
// config.yaml wants), ending in suffix, so that tests sharing the server
// never see each other's tasks.
func Queue(tb testing.TB, suffix string) string {
	p := strings.TrimSuffix(Prefix(tb), ":")
	p = strings.ToLower(strings.NewReplacer("/", "-", ":", "-", "test-", "").Replace(p))
	// Anything else a subtest name may hold (commas, parentheses) would
	// need quoting in the configs tests write.
	p = strings.Map(func(r rune) rune {
		if 'a' <= r && r <= 'z' || '0' <= r && r <= '9' || r == '-' || r == '_' {
			return r
		}
		return '_'
	}, p)
	return p + "-" + suffix
}

// QueueInfo returns asynq's view of queue on the standalone server.
func QueueInfo(tb testing.TB, queue string) *asynq.QueueInfo {
	tb.Helper()
	inspector := asynq.NewInspector(asynq.RedisClientOpt{Addr: Addr(tb)})
	defer inspector.Close()
	info, err := inspector.GetQueueInfo(queue)
	if err != nil {
		tb.Fatalf("asynq queue %q: %v", queue, err)
	}
	return info
}

// Server is a redis-server of the test's own, which it may kill and start
// again (its data dir stays), for tests that need a server no other test
// touches: faults, private script caches, special configs.
type Server struct {
	Addr string
	dir  string
	args []string
	tls  *tls.Config // how Start's PING connects; nil: plain TCP
	cmd  *exec.Cmd
}

// StartServer starts a redis-server on a free loopback port with extra
// args (append-only, fsync always, unless args say otherwise) and stops it
// when the test ends.
func StartServer(tb testing.TB, args ...string) *Server {
	tb.Helper()
	s := &Server{Addr: testkit.FreeAddr(tb), dir: tb.TempDir(), args: args}
	s.Start(tb)
	tb.Cleanup(s.Kill)
	return s
}

// Start starts the server again after Kill; it returns once it answers PING
// (a restarted server answers LOADING until its append-only file is read).
func (s *Server) Start(tb testing.TB) {
	tb.Helper()
	server := env(tb, "SLUICE_TEST_REDIS_SERVER")
	_, port, _ := net.SplitHostPort(s.Addr)
	args := append([]string{"--port", port, "--bind", "127.0.0.1", "--dir", s.dir,
		"--appendonly", "yes", "--appendfsync", "always", "--save", "", "--logfile", filepath.Join(s.dir, "redis.log")}, s.args...)
	s.cmd = exec.Command(server, args...)
	if err := s.cmd.Start(); err != nil {
		tb.Fatal(err)
	}
	rdb := redis.NewClient(&redis.Options{Addr: s.Addr, MaxRetries: -1, TLSConfig: s.tls})
	defer rdb.Close()
	deadline := time.Now().Add(20 * time.Second)
	for rdb.Ping(context.Background()).Err() != nil {
		if time.Now().After(deadline) {
			log, _ := os.ReadFile(filepath.Join(s.dir, "redis.log"))
			tb.Fatalf("redis-server on %s did not answer PING within 20s; its log:\n%s", s.Addr, log)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// alive reports whether the server was started and not killed since.
func (s *Server) alive() bool { return s.cmd != nil && s.cmd.ProcessState == nil }

// Kill kills the server at once (SIGKILL), as a crash would.
func (s *Server) Kill() {
	if s.alive() {
		s.cmd.Process.Kill()
		s.cmd.Wait()
	}
}

// ACLUser makes a user of the standalone server that may run every
// command, on every channel, but only on keys that match patterns (Redis
// glob patterns), and removes it when the test ends: for tests of what a
// client does when Redis refuses it some keys.
func ACLUser(tb testing.TB, patterns ...string) (user, password string) {
	tb.Helper()
	rdb := Client(tb)
	user, password = "test-"+randomHex(tb), "pw"
	args := []any{"ACL", "SETUSER", user, "on", ">" + password, "+@all", "&*"}
	for _, p := range patterns {
		args = append(args, "~"+p)
	}
	if err := rdb.Do(context.Background(), args...).Err(); err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { rdb.Do(context.Background(), "ACL", "DELUSER", user) })
	return user, password
}
