// Package redistest connects tests to the real Redis servers that
// `make test` (scripts/redis-env.sh) starts for the run: a standalone
// redis-server and a 3-master Redis Cluster.
package redistest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"os"
	"strings"
	"testing"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
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

// Client connects to the standalone server and closes the client when the
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
	var b [6]byte
	if _, err := rand.Read(b[:]); err != nil {
		tb.Fatal(err)
	}
	name := strings.NewReplacer("{", "(", "}", ")", " ", "_").Replace(tb.Name())
	return "test:" + name + ":" + hex.EncodeToString(b[:]) + ":"
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
