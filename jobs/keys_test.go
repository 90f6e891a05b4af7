package jobs

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/sluicehq/sluice/internal/redistest"
	"github.com/sluicehq/sluice/internal/testkit"
)

func TestKeyExprCompileErrors(t *testing.T) {
	for _, tc := range []struct {
		desc, source string
		want         []string // in the error
	}{
		{"undeclared variable", `paylod.tenant`, []string{"at 1:1", "undeclared reference to 'paylod'"}},
		{"syntax", `payload.headers["X-Tenant"`, []string{"at 1:27", "Syntax error"}},
		{"wrong result type", `size(payload.x) > 3`, []string{"must give a string", "bool"}},
		{"host of a number", `host(3)`, []string{"at 1:5", "no matching overload"}},
		{"too long", strings.Repeat("a", maxKeyExpr+1), []string{"at most 1024 characters"}},
		{"empty", ` `, []string{"must be a CEL expression"}},
	} {
		t.Run(tc.desc, func(t *testing.T) {
			_, err := compileKey(tc.source)
			if err == nil {
				t.Fatalf("compileKey(%q) = nil error", tc.source)
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("compileKey(%q) = %q, want it to say %q", tc.source, err, w)
				}
			}
		})
	}
}

func TestConfigNamesKeyAndPosition(t *testing.T) {
	cfg := Config{
		Queues: map[string]QueueConfig{"q": {
			Drain:    &LimitConfig{Limit: 10, Period: time.Second, OnKeyError: OnKeyErrorWait, HashKeys: true},
			Fairness: &FairnessConfig{Key: `payload.headers["X-Tenant"] +`, Weights: map[string]int{"vip": 0}},
		}},
		Quotas: map[string]LimitConfig{"api": {Limit: 4, Period: time.Second, Key: `host(payload.url`, OnKeyError: "skip",
			Overrides: map[string]LimitOverride{"big": {Limit: -1}}}},
		Tasks: map[string]TaskConfig{"t": {Quotas: []string{"api"}, ConcurrencyKey: `payload.x`}},
	}.Defaults()
	var got []string
	for _, err := range cfg.Validate() {
		got = append(got, err.Error())
	}
	joined := strings.Join(got, "\n")
	for _, want := range []string{
		"queues.q.fairness.key: at 1:30: Syntax error",
		"queues.q.fairness.weights.vip: must be between 1 and 1000, got 0",
		"quotas.api.key: at 1:17: Syntax error",
		"quotas.api.overrides.big.limit: must be > 0, got -1",
		"tasks.t.concurrency_key: needs tasks.t.concurrency",
		"queues.q.drain.on_key_error: applies to a keyed limit, but the limit has no key; give it one (queues.q.drain.key)",
		"queues.q.drain.hash_keys: applies to a keyed limit, but the limit has no key; give it one (queues.q.drain.key)",
		`quotas.api.on_key_error: must be default or wait, got "skip"`,
	} {
		if !strings.Contains(joined, want) {
			t.Errorf("problems:\n%s\nwant one starting %q", joined, want)
		}
	}
}

func TestKeyValues(t *testing.T) {
	for _, tc := range []struct {
		desc, source, payload, want string
		fails                       bool
	}{
		{"header", `payload.headers["X-Tenant"]`, `{"headers": {"X-Tenant": "acme"}}`, "acme", false},
		{"host", `host(payload.url)`, `{"url": "https://API.Example.com:8443/a?b"}`, "api.example.com", false},
		{"whole number", `payload.customer`, `{"customer": 42}`, "42", false},
		{"type and queue", `type + "/" + queue`, `{}`, "test:call/q", false},
		{"missing field", `payload.headers["X-Tenant"]`, `{"url": "x"}`, "", true},
		{"not JSON", `payload.a`, `not json`, "", true},
		{"host without one", `host(payload.url)`, `{"url": "/relative"}`, "", true},
		{"a list", `payload.a`, `{"a": [1]}`, "", true},
		{"the longest kept", `payload.a`, `{"a": "` + strings.Repeat("x", maxKeyName) + `"}`, strings.Repeat("x", maxKeyName), false},
		// sha256 of 257 x's, its first 16 bytes.
		{"longer: its hash", `payload.a`, `{"a": "` + strings.Repeat("x", maxKeyName+1) + `"}`, "sha256:15eb95a462ee20bd91a415ae2d4aed34", false},
	} {
		t.Run(tc.desc, func(t *testing.T) {
			k, err := compileKey(tc.source)
			if err != nil {
				t.Fatal(err)
			}
			got, err := k.eval(newTaskVars("q", "id", "test:call", []byte(tc.payload)))
			if tc.fails != (err != nil) || got != tc.want {
				t.Errorf("eval = %q, %v; want %q (fails: %v)", got, err, tc.want, tc.fails)
			}
		})
	}
}

// TestKeyedQuotaOverridesAndFallback: a quota keyed by a header, 2 per
// second burst 2, with an override of 5 for "big": each key holds its own
// limit, the override its own, and tasks whose key fails share one default
// key, each failure counted.
func TestKeyedQuotaOverridesAndFallback(t *testing.T) {
	clock := testkit.NewClock(t0)
	queue, quota := redistest.Queue(t, "q"), redistest.Queue(t, "api")
	cfg := Config{
		Queues: map[string]QueueConfig{queue: {}},
		Quotas: map[string]LimitConfig{quota: {Algorithm: "token_bucket", Limit: 2, Period: time.Second, Burst: 2,
			Key: `payload.dest`, Overrides: map[string]LimitOverride{"big": {Limit: 5, Burst: 5}}}},
		Tasks: map[string]TaskConfig{"test:call": {Quotas: []string{quota}}},
	}
	reg := prometheus.NewRegistry()
	m := NewMetrics(reg)
	s, err := NewScheduler(redistest.Client(t), asynq.RedisClientOpt{Addr: redistest.Addr(t)}, cfg, m,
		slog.New(slog.NewTextHandler(io.Discard, nil)), WithClock(clock))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	now := func(payload string) bool {
		b, err := bookTask(context.Background(), s.booker, s.gates.Load(), queue, payload+time.Now().String(), asynq.NewTask("test:call", []byte(payload)), false)
		if err != nil {
			t.Fatal(err)
		}
		return b.askIn == 0 && !b.ready.After(clock.Now())
	}
	count := func(payload string) int {
		n := 0
		for range 10 {
			if now(payload) {
				n++
			}
		}
		return n
	}
	for _, tc := range []struct {
		payload string
		want    int
	}{
		{`{"dest": "a"}`, 2}, {`{"dest": "b"}`, 2}, {`{"dest": "big"}`, 5}, {`{}`, 2}, {`{"dest": ["x"]}`, 0},
	} {
		if got := count(tc.payload); got != tc.want {
			t.Errorf("%s: %d of 10 passed at once, want %d", tc.payload, got, tc.want)
		}
	}
	// {} and {"dest": ["x"]} both fell into the default key: 20 failures.
	if got := testutil.ToFloat64(m.keyFallbacks.WithLabelValues("quota:" + quota)); got != 20 {
		t.Errorf("sluice_key_fallbacks_total = %v, want 20", got)
	}
}

// TestKeyCostBounded: an expression whose work grows with the payload
// stops at maxKeyCost (the task takes the limit's default key); one whose
// work does not (a field selection) runs on the same payload.
func TestKeyCostBounded(t *testing.T) {
	var list strings.Builder
	list.WriteString(`{"k": "v", "l": [0`)
	for i := 1; i < 100_000; i++ {
		list.WriteString(",1")
	}
	list.WriteString(`]}`)
	payload := []byte(list.String())
	for _, tc := range []struct {
		source string
		fails  bool
	}{
		{`payload.l.map(x, string(x)).join(",")`, true},
		{`payload.l.exists(x, x == 2) ? "two" : "none"`, true},
		{`payload.k`, false},
	} {
		k, err := compileKey(tc.source)
		if err != nil {
			t.Fatal(err)
		}
		got, err := k.eval(newTaskVars("q", "id", "t", payload))
		if tc.fails {
			if err == nil || !strings.Contains(err.Error(), "cost limit") {
				t.Errorf("%s over 100,000 elements = %.40q, %v; want the cost limit's error", tc.source, got, err)
			}
		} else if err != nil || got != "v" {
			t.Errorf("%s = %q, %v; want v", tc.source, got, err)
		}
	}
}

// TestKeyErrorWait: on a quota keyed by payload.token with on_key_error:
// wait, a task whose payload has no token (a typo, tokn) does not run on
// the default key: it waits in asynq's retry set, its retries untouched,
// its last error sluice's wait; the failure is counted and logged at
// ERROR naming the gate, the expression and the problem. A task with a
// token runs. Without the setting the same task runs on the default key.
func TestKeyErrorWait(t *testing.T) {
	queue, quota := redistest.Queue(t, "q"), redistest.Queue(t, "api")
	cfg := Config{
		Queues: map[string]QueueConfig{queue: {}},
		Quotas: map[string]LimitConfig{quota: {Limit: 5, Period: time.Second, Key: `payload.token`, OnKeyError: OnKeyErrorWait}},
		Tasks:  map[string]TaskConfig{"test:call": {Quotas: []string{quota}}},
	}
	var log testkit.SyncBuffer
	m := NewMetrics(prometheus.NewRegistry())
	s, err := NewScheduler(redistest.Client(t), asynq.RedisClientOpt{Addr: redistest.Addr(t)}, cfg, m, slog.New(slog.NewTextHandler(&log, nil)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	var ran sync.Map
	mux := asynq.NewServeMux()
	mux.Use(s.Middleware)
	mux.HandleFunc("test:call", func(_ context.Context, t *asynq.Task) error {
		ran.Store(string(t.Payload()), true)
		return nil
	})
	client := serve(t, s, mux)
	for _, payload := range []string{`{"tokn": "secret-a"}`, `{"token": "secret-b"}`} {
		if _, err := client.Enqueue(asynq.NewTask("test:call", []byte(payload)), asynq.Queue(queue), asynq.TaskID(payload)); err != nil {
			t.Fatal(err)
		}
	}
	inspector := asynq.NewInspector(asynq.RedisClientOpt{Addr: redistest.Addr(t)})
	defer inspector.Close()
	bad := `{"tokn": "secret-a"}`
	testkit.WaitFor(t, 10*time.Second, "the task without a token to wait in the retry set", func() bool {
		info, err := inspector.GetTaskInfo(queue, bad)
		return err == nil && info.State == asynq.TaskStateRetry
	})
	testkit.WaitFor(t, 10*time.Second, "the task with a token to run", func() bool { _, ok := ran.Load(`{"token": "secret-b"}`); return ok })
	info, err := inspector.GetTaskInfo(queue, bad)
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := ran.Load(bad); ok || info.Retried != 0 || !strings.Contains(info.LastErr, "(not a failure)") {
		t.Errorf("the task without a token: ran %v, retried %d, last error %q; want not run, 0, sluice's wait", ok, info.Retried, info.LastErr)
	}
	if got := testutil.ToFloat64(m.keyWaits.WithLabelValues("quota:" + quota)); got != 1 {
		t.Errorf("sluice_key_waits_total = %v, want 1", got)
	}
	for _, want := range []string{"level=ERROR", "on_key_error: wait", "gate=quota:" + quota, "key=payload.token", "no such key: token"} {
		if !strings.Contains(log.String(), want) {
			t.Errorf("the log does not say %q:\n%s", want, log.String())
		}
	}
	t.Logf("log: %s", log.String())
}

// TestHashedKeys: a quota keyed by token with hash_keys keeps each token
// by its hash: after bookings of three tokens, no Redis key name holds a
// token; each token holds its own limit, an override given by the token
// and one given by its hashed name both match; KeyLoadOf finds a token's
// key by its value, named by its hash.
func TestHashedKeys(t *testing.T) {
	clock := testkit.NewClock(t0)
	queue, quota := redistest.Queue(t, "q"), redistest.Queue(t, "api")
	cfg := Config{
		Queues: map[string]QueueConfig{queue: {}},
		Quotas: map[string]LimitConfig{quota: {Algorithm: "token_bucket", Limit: 2, Period: time.Second, Burst: 2, Key: `payload.token`, HashKeys: true,
			Overrides: map[string]LimitOverride{"tok-big-secret": {Limit: 5, Burst: 5}, hashedKey("tok-other-secret"): {Limit: 3, Burst: 3}}}},
		Tasks: map[string]TaskConfig{"test:call": {Quotas: []string{quota}}},
	}
	rdb := redistest.Client(t)
	s := newScheduler(t, rdb, cfg, WithClock(clock))
	booked := 0 // task ids hold no token
	passed := func(token string) int {
		n := 0
		for range 10 {
			booked++
			b, err := bookTask(context.Background(), s.booker, s.gates.Load(), queue, fmt.Sprint("task-", booked), asynq.NewTask("test:call", []byte(`{"token": "`+token+`"}`)), false)
			if err != nil {
				t.Fatal(err)
			}
			if b.askIn == 0 && !b.ready.After(clock.Now()) {
				n++
			}
		}
		return n
	}
	for token, want := range map[string]int{"tok-alpha-secret": 2, "tok-big-secret": 5, "tok-other-secret": 3} {
		if got := passed(token); got != want {
			t.Errorf("%s: %d of 10 passed at once, want %d", token, got, want)
		}
	}
	keys, err := rdb.Keys(context.Background(), "*"+quota+"*").Result()
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range keys {
		if strings.Contains(k, "secret") {
			t.Errorf("Redis key %q holds a token", k)
		}
	}
	if len(keys) == 0 {
		t.Fatal("no Redis key of the quota")
	}
	load, found, err := KeyLoadOf(context.Background(), rdb, cfg, quota, "tok-alpha-secret")
	if err != nil || !found || load.Key != hashedKey("tok-alpha-secret") || load.Throttled != 8 {
		t.Errorf("KeyLoadOf(tok-alpha-secret) = %+v, %v, %v; want its hashed key %s, 8 throttled", load, found, err, hashedKey("tok-alpha-secret"))
	}
	t.Logf("Redis keys: %q; KeyLoadOf: %+v", keys, load)
}
