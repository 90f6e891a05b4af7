package config

import (
	"context"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/jobs"
)

// contract is the full config of the documented contract.
const contract = `
redis:   {addr: 127.0.0.1:6379, username: "", password: "", db: 0, tls: false, tls_ca_file: "", tls_cert_file: "", tls_key_file: "", tls_server_name: "", cluster: []}
worker:  {concurrency: 10, metrics_addr: 127.0.0.1:2112, hold_max: 1s, reserve_max: 1m, waiting: 10}
queues:
  emails: {priority: 3, concurrency: 0, drain: {algorithm: leaky_bucket, limit: 20, period: 1s, burst: 1, windows: 0, on_redis_error: local}}
quotas:
  example-api: {algorithm: token_bucket, limit: 10, period: 1s, burst: 5, windows: 0, on_redis_error: deny, max_block: 10m, guard: 20ms}
tasks:
  http:request: {quotas: [example-api], cost: 1, concurrency: 0}
http:    {allow: [127.0.0.1, api.example.com]}
gateway:
  listen: 127.0.0.1:8080
  trusted_proxies: []            # CIDRs
  limits:
    - {name: overall,    key: global, algorithm: token_bucket,    limit: 1000, period: 1s, burst: 2000}
    - {name: per-client, key: client, algorithm: sliding_log,     limit: 60,   period: 1m}
    - {name: per-ip,     key: ip,     algorithm: sliding_counter, limit: 300,  period: 1m}
  ban: {after: 20, within: 1m, for: 5m, max: 24h}
  types: [demo:noop, demo:sleep]
  clients:
    - {name: billing, key_sha256: 9F86D081884C7D659A2FEAA0C55AD015A3BF4F1B2B0B822CD15D6C15B0F00A08, types: [demo:noop], queues: [emails]}
  allow_anonymous: false
  metrics_addr: 127.0.0.1:2113
  max_connections: 256
`

// write puts content in a config file in a fresh directory.
func write(t *testing.T, content string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "config.yaml")
	if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

func TestLoadContract(t *testing.T) {
	got, err := Load(write(t, contract))
	if err != nil {
		t.Fatal(err)
	}
	want := File{
		Redis: Redis{Addr: "127.0.0.1:6379", Cluster: []string{}},
		Jobs: jobs.Config{
			Worker: jobs.WorkerConfig{Concurrency: 10, MetricsAddr: "127.0.0.1:2112", HoldMax: time.Second, ReserveMax: time.Minute, Waiting: 10},
			Queues: map[string]jobs.QueueConfig{
				"emails": {Priority: 3, Shards: 1, Drain: &jobs.LimitConfig{Algorithm: "leaky_bucket", Limit: 20, Period: time.Second, Burst: 1, OnRedisError: "local"}},
			},
			Quotas: map[string]jobs.LimitConfig{
				"example-api": {Algorithm: "token_bucket", Limit: 10, Period: time.Second, Burst: 5, OnRedisError: "deny", MaxBlock: 10 * time.Minute, Guard: 20 * time.Millisecond},
			},
			Tasks: map[string]jobs.TaskConfig{"http:request": {Quotas: []string{"example-api"}, Cost: 1}},
			HTTP:  jobs.HTTPConfig{Allow: []string{"127.0.0.1", "api.example.com"}},
		},
		Gateway: Gateway{
			Listen:         "127.0.0.1:8080",
			TrustedProxies: []string{},
			Limits: []GatewayLimit{
				{Name: "overall", Key: "global", Algorithm: "token_bucket", Limit: 1000, Period: time.Second, Burst: 2000, OnRedisError: "deny"},
				{Name: "per-client", Key: "client", Algorithm: "sliding_log", Limit: 60, Period: time.Minute, OnRedisError: "deny"},
				{Name: "per-ip", Key: "ip", Algorithm: "sliding_counter", Limit: 300, Period: time.Minute, OnRedisError: "deny"},
			},
			Ban:   Ban{After: 20, Within: time.Minute, For: 5 * time.Minute, Max: 24 * time.Hour},
			Types: []string{"demo:noop", "demo:sleep"},
			Clients: []GatewayClient{{Name: "billing", KeySHA256: "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
				Types: []string{"demo:noop"}, Queues: []string{"emails"}}},
			MetricsAddr:    "127.0.0.1:2113",
			MaxConnections: 256,
		},
	}
	got.digest = [32]byte{} // not part of the contract
	if !reflect.DeepEqual(got, want) {
		t.Errorf("Load(contract) =\n%+v\nwant\n%+v", got, want)
	}
}

func TestLoadKeepsNames(t *testing.T) {
	for _, tt := range []struct {
		desc, yaml string
		check      func(File) bool
	}{
		{
			desc:  "queue name with dashes and dots",
			yaml:  "queues: {emails-eu.v2: {priority: 2}}",
			check: func(f File) bool { return f.Jobs.Queues["emails-eu.v2"].Priority == 2 && len(f.Jobs.Queues) == 1 },
		},
		{
			desc: "quota name with dots and dashes",
			yaml: "quotas: {api.example-2.com: {limit: 1, period: 1s}}\ntasks: {x: {quotas: [api.example-2.com]}}",
			check: func(f File) bool {
				return f.Jobs.Quotas["api.example-2.com"].Limit == 1 && len(f.Jobs.Quotas) == 1 &&
					f.Jobs.Tasks["x"].Quotas[0] == "api.example-2.com"
			},
		},
		{
			desc:  "task type with colons",
			yaml:  "tasks: {'mail:send:v2': {cost: 3}}",
			check: func(f File) bool { return f.Jobs.Tasks["mail:send:v2"].Cost == 3 && len(f.Jobs.Tasks) == 1 },
		},
		{
			desc:  "aliases",
			yaml:  "quotas: {a: &q {limit: 7, period: 1s}, b: *q}",
			check: func(f File) bool { return f.Jobs.Quotas["a"].Limit == 7 && f.Jobs.Quotas["b"].Limit == 7 },
		},
		{
			desc:  "merge keys",
			yaml:  "quotas: {a: &q {limit: 1, period: 1s}, b: {<<: *q, limit: 2}}",
			check: func(f File) bool { return f.Jobs.Quotas["b"].Limit == 2 && f.Jobs.Quotas["b"].Period == time.Second },
		},
		{
			desc: "names with no keys",
			yaml: "queues: {bulk: {}, idle: }\ntasks: {'noop:v1': {}}",
			check: func(f File) bool {
				return f.Jobs.Queues["bulk"].Priority == 1 && f.Jobs.Queues["idle"].Priority == 1 && f.Jobs.Tasks["noop:v1"].Cost == 1
			},
		},
		{
			desc: "a list as a comma-separated string",
			yaml: "http: {allow: 'a.example.com, b.example.com'}",
			check: func(f File) bool {
				return reflect.DeepEqual(f.Jobs.HTTP.Allow, []string{"a.example.com", "b.example.com"})
			},
		},
		{
			desc: "names keep their case (asynq's queue names are case-sensitive)",
			yaml: "queues: {Emails: {priority: 2}, emails: {}}\nquotas: {API.example.com: {limit: 1, period: 1s}}\ntasks: {'http:Request': {quotas: [API.example.com]}}",
			check: func(f File) bool {
				return f.Jobs.Queues["Emails"].Priority == 2 && f.Jobs.Queues["emails"].Priority == 1 &&
					f.Jobs.Quotas["API.example.com"].Limit == 1 && f.Jobs.Tasks["http:Request"].Quotas[0] == "API.example.com"
			},
		},
		{
			desc:  "names with colons anywhere",
			yaml:  "tasks: {'mail::send': {cost: 2}, 'mail:': {}}",
			check: func(f File) bool { return f.Jobs.Tasks["mail::send"].Cost == 2 && f.Jobs.Tasks["mail:"].Cost == 1 },
		},
		{
			desc:  "keys are case-insensitive",
			yaml:  "Worker: {Hold_Max: 2s}",
			check: func(f File) bool { return f.Jobs.Worker.HoldMax == 2*time.Second },
		},
		{
			desc: "defaults",
			yaml: "queues: {q: {drain: {limit: 1, period: 1s}}}\ngateway: {limits: [{name: a, key: ip, limit: 1, period: 1s}], ban: {after: 1, within: 1s, for: 1m}}",
			check: func(f File) bool {
				return f.Jobs.Queues["q"].Priority == 1 && f.Jobs.Queues["q"].Drain.Algorithm == "leaky_bucket" &&
					f.Jobs.Worker.Concurrency == 10 && f.Gateway.Listen == "127.0.0.1:8080" &&
					f.Gateway.Limits[0].Algorithm == "token_bucket" && f.Gateway.Ban.Max == time.Minute
			},
		},
	} {
		t.Run(tt.desc, func(t *testing.T) {
			f, err := Load(write(t, "redis: {addr: 127.0.0.1:6379}\n"+tt.yaml))
			if err != nil {
				t.Fatal(err)
			}
			if !tt.check(f) {
				t.Errorf("got %+v", f.Jobs)
			}
		})
	}
}

func TestLoadProblems(t *testing.T) {
	const addr = "redis: {addr: 127.0.0.1:6379}\n"
	for _, tt := range []struct {
		desc string
		yaml string
		env  map[string]string
		want []string // each problem, in order, contains its string
	}{
		{desc: "unknown key", yaml: addr + "queues: {emails: {drain: {limit: 1, period: 1s, drian: 2}}}",
			want: []string{"queues.emails.drain.drian: unknown key"}},
		// 9.10: an unknown key must not make the rest of its entry look unset.
		{desc: "unknown key beside good values", yaml: addr + "quotas: {api: {algorithm: token_bucket, limit: 50, period: 1s, bogus: 1}}",
			want: []string{"quotas.api.bogus: unknown key"}},
		{desc: "unknown key beside a bad value", yaml: addr + "queues: {q: {priority: -1, bogus: 1, drain: {limit: 0, period: 1s, nope: 2}}}",
			want: []string{
				"queues.q.bogus: unknown key",
				"queues.q.drain.nope: unknown key",
				"queues.q.priority: must be >= 1, got -1",
				"queues.q.drain.limit: must be > 0, got 0",
			}},
		// 20.2: a guard is bounded, and only where it means something.
		{desc: "guards", yaml: addr + `queues: {q: {drain: {limit: 5, period: 1s, guard: 50ms}}}
quotas:
  cal: {algorithm: fixed_window, limit: 5, period: 1m, guard: 50ms}
  long: {algorithm: sliding_log, limit: 5, period: 1s, guard: 2s}
  neg: {algorithm: token_bucket, limit: 5, period: 1s, burst: 5, guard: -1ms}`,
			want: []string{
				"queues.q.drain.guard: applies to quotas only",
				"quotas.cal.guard: a fixed_window counts the upstream's own calendar windows",
				"quotas.long.guard: must be between 1ms and 10s, and at most the period (1s), got 2s",
				"quotas.neg.guard: must be between 1ms and 10s, and at most the period (1s), got -1ms",
			}},
		{desc: "a guard from the environment", yaml: addr + "quotas: {api: {algorithm: sliding_log, limit: 5, period: 1s}}",
			env:  map[string]string{"SLUICE_QUOTAS_API_GUARD": "20s"},
			want: []string{"SLUICE_QUOTAS_API_GUARD: quotas.api.guard: must be between 1ms and 10s, and at most the period (1s), got 20s"}},
		{desc: "unknown key in another case", yaml: addr + "Worker:\n  Concurency: 20",
			want: []string{"config.yaml:3: worker.concurency: unknown key"}},
		{desc: "unknown worker key", yaml: addr + "worker:\n  concurency: 20",
			want: []string{"worker.concurency: unknown key; known keys here are concurrency, metrics_addr, hold_max, reserve_max, waiting, ui"}},
		{desc: "unknown section", yaml: addr + "queue: {emails: {priority: 2}}",
			want: []string{"queue: unknown key; known keys here are redis, worker, queues, quotas, tasks, http, gateway"}},
		{desc: "unknown key in a list item", yaml: addr + "gateway: {limits: [{name: a, key: ip, limit: 1, period: 1s, burts: 2}]}",
			want: []string{"gateway.limits[0].burts: unknown key; known keys here are name, key, algorithm, limit, period, burst, windows, on_redis_error"}},
		{desc: "unknown algorithm", yaml: addr + "quotas: {api: {algorithm: token-bucket, limit: 1, period: 1s}}",
			want: []string{"quotas.api.algorithm:"}},
		{desc: "zero limit", yaml: addr + "quotas: {api: {limit: 0, period: 1s}}",
			want: []string{"quotas.api.limit:"}},
		{desc: "negative limit", yaml: addr + "queues: {emails: {drain: {limit: -3, period: 1s}}}",
			want: []string{"queues.emails.drain.limit:"}},
		{desc: "limit not a number", yaml: addr + "queues:\n  emails:\n    drain: {limit: ten, period: 1s}",
			want: []string{`queues.emails.drain.limit: must be a whole number, got "ten"`}},
		{desc: "bad value under a name with dots", yaml: addr + "quotas: {api.example.com: {limit: 1, period: 1s, burst: 1.5}}\ntasks: {'http:request': {quotas: [api.example.com]}}",
			want: []string{`quotas.api.example.com.burst: must be a whole number, got "1.5"`}},
		{desc: "task names unknown quota", yaml: addr + "tasks: {'http:request': {quotas: [example-api]}}",
			want: []string{`tasks.http:request.quotas: names quota "example-api"`}},
		{desc: "duration without unit", yaml: addr + "quotas: {api: {limit: 1, period: 5}}",
			want: []string{`quotas.api.period: must be a duration with a unit, like 1s`}},
		{desc: "bad duration", yaml: addr + "worker: {hold_max: soon}",
			want: []string{`worker.hold_max: must be a duration`}},
		{desc: "missing redis.addr", yaml: "worker: {concurrency: 2}",
			want: []string{"redis.addr: must be set"}},
		{desc: "empty file", yaml: "",
			want: []string{"redis.addr: must be set"}},
		{desc: "cluster with db", yaml: "redis: {cluster: [a:1, b], db: 2}",
			want: []string{"redis.cluster[1]: must be host:port", "redis.db: must be 0 with redis.cluster"}},
		{desc: "wrong shapes", yaml: "redis: {addr: 127.0.0.1:6379, tls: maybe}\nhttp: {allow: {a: 1}}\nqueues: [a]\nworker: 3\ngateway: {listen: [a]}",
			want: []string{ // in the file's order
				`config.yaml:1: redis.tls: must be true or false, got "maybe"`,
				`config.yaml:2: http.allow: must be a list, like [a, b], got a mapping`,
				`config.yaml:3: queues: must be a mapping of names, got a list`,
				`config.yaml:4: worker: must be a mapping with keys concurrency, metrics_addr, hold_max, reserve_max, waiting, ui, got "3"`,
				`config.yaml:5: gateway.listen: must be a string, got a list`,
			}},
		{desc: "key set twice", yaml: addr + "worker: {concurrency: 1, concurrency: 2}",
			want: []string{`config.yaml:2: worker.concurrency: set twice; first at line 2`}},
		{desc: "section set twice", yaml: addr + "worker: {}\nredis: {}",
			want: []string{`config.yaml:3: redis: set twice; first at line 1`}},
		{desc: "key set twice in another case", yaml: addr + "worker: {concurrency: 1, Concurrency: 2}",
			want: []string{`config.yaml:2: worker.concurrency: set twice; first at line 2`}},
		{desc: "name set twice", yaml: addr + "queues:\n  q: {}\n  q: {priority: 2}",
			want: []string{`config.yaml:4: queues.q: set twice; first at line 3`}},
		{desc: "not YAML", yaml: "redis: [",
			want: []string{"config.yaml: not valid YAML: line 1: did not find expected node content"}},
		{desc: "gateway", yaml: addr + `gateway:
  listen: localhost
  trusted_proxies: [10.0.0.0/8, 10.0.0.1]
  limits:
    - {name: a, key: user, limit: 1, period: 1s}
    - {name: a, key: ip, limit: 1, period: 1s, on_redis_error: maybe}
    - {key: ip, limit: 1, period: 1s, algorithm: nope}
  ban: {after: 3, within: 0s, for: 5m, max: 1m}`,
			want: []string{
				`gateway.listen: must be host:port`,
				`gateway.trusted_proxies[1]: must be a CIDR`,
				`gateway.limits[0].key: must be global, client, ip or type, got "user"`,
				`gateway.limits[1].name: "a" is already the name of gateway.limits[0]`,
				`gateway.limits[1].on_redis_error: must be deny, allow or local`,
				`gateway.limits[2].name: must be set`,
				`gateway.limits[2].algorithm:`,
				`gateway.ban.within: must be > 0`,
				`gateway.ban.max: must be >= gateway.ban.for (5m0s), got 1m0s`,
			}},
		{desc: "gateway clients and types", yaml: addr + `queues: {q: {}}
gateway:
  metrics_addr: 127.0.0.1:8080
  max_connections: 0
  types: [demo:noop, http:get]
  clients:
    - {name: a, key_sha256: secret-pasted-by-mistake, types: [demo:sleep], queues: [q, nope]}
    - {name: a, key_sha256: 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08}
    - {key_sha256: 9F86D081884C7D659A2FEAA0C55AD015A3BF4F1B2B0B822CD15D6C15B0F00A08}`,
			want: []string{
				`gateway.metrics_addr: must differ from gateway.listen (127.0.0.1:8080)`,
				`gateway.types[1]: "http:get" is not a task type the intake knows; known: demo:noop, demo:sleep, http:request`,
				`gateway.clients[0].key_sha256: must be the SHA-256 of the key as 64 hex digits (printf %s KEY | sha256sum), got 24 characters`,
				`gateway.clients[0].types[0]: "demo:sleep" is not in gateway.types (demo:noop, http:get)`,
				`gateway.clients[1].name: "a" is already the name of gateway.clients[0]`,
				`gateway.clients[2].name: must be set: it names the item in logs`,
				`gateway.clients[2].key_sha256: is the same as gateway.clients[1]'s`,
				`gateway.clients[0].queues[1]: "nope" is not under queues`,
			}},
		{desc: "web UI writes without a login", yaml: addr + "worker: {ui: {writes: true}}",
			want: []string{"worker.ui.writes: true needs worker.ui.user and worker.ui.password_hash"}},
		{desc: "web UI password that is not a bcrypt hash", yaml: addr + "worker: {ui: {password_hash: hunter2}}",
			want: []string{
				"worker.ui.password_hash: must be a bcrypt hash like $2a$10$... (worker --hash-password makes one from a password on stdin), got 7 characters",
				"worker.ui.user: must be set with worker.ui.password_hash",
			}},
		{desc: "several at once", yaml: `
worker: {concurency: 2, hold_max: 2}
queues: {emails: {drain: {algorithm: leaky, limit: 0, period: 1s}}}
tasks: {'http:request': {quotas: [nope], cost: -1}}`,
			want: []string{
				"worker.concurency: unknown key",
				"worker.hold_max: must be a duration",
				"redis.addr: must be set",
				`queues.emails.drain.algorithm: must be one of [fixed_window sliding_log sliding_counter token_bucket leaky_bucket], got "leaky"`,
				"tasks.http:request.quotas: names quota",
				"tasks.http:request.cost: must be >= 1, got -1",
			}},
		// asynq refuses an empty task type or queue name; a task of another
		// type must not take the limits of one named "".
		{desc: "empty task type and queue names", yaml: addr + `
queues: {"": {drain: {algorithm: leaky_bucket, limit: 1, period: 1s}}}
tasks: {"": {cost: 1}}`,
			want: []string{
				`queues."": a queue's name must not be empty`,
				`tasks."": a task type must not be empty`,
			}},
		{desc: "bad environment value", yaml: addr, env: map[string]string{"SLUICE_WORKER_CONCURRENCY": "ten"},
			want: []string{`SLUICE_WORKER_CONCURRENCY: worker.concurrency: must be a whole number, got "ten"`}},
		{desc: "bad environment duration", yaml: addr, env: map[string]string{"SLUICE_WORKER_HOLD_MAX": "5"},
			want: []string{`SLUICE_WORKER_HOLD_MAX: worker.hold_max: must be a duration with a unit, like 1s, 500ms or 5m, got "5"`}},
		{desc: "bad environment list item", yaml: addr, env: map[string]string{"SLUICE_REDIS_CLUSTER": "h1:7000,h2"},
			want: []string{`SLUICE_REDIS_CLUSTER: redis.cluster[1]: must be host:port with a port from 1 to 65535, like 127.0.0.1:6379, got "h2"`}},
		{desc: "environment value fails validation", yaml: addr, env: map[string]string{"SLUICE_GATEWAY_BAN_AFTER": "-1"},
			want: []string{`SLUICE_GATEWAY_BAN_AFTER: gateway.ban.after: must be >= 0 (0: no bans), got -1`}},
		// 25.3: a sharded queue's shard count, from the file and the environment.
		{desc: "shards", yaml: addr + `queues:
  ok: {shards: 3, drain: {limit: 300, period: 1s}}
  many: {shards: 65}
  windowed: {shards: 2, drain: {algorithm: sliding_log, limit: 5, period: 1s}}`,
			want: []string{
				"config.yaml:4: queues.many.shards: must be from 1 (one asynq queue, the default) to 64, got 65",
				"config.yaml:5: queues.windowed.shards: needs a bucket drain (leaky_bucket or token_bucket) to share among the shards, got sliding_log",
			}},
		{desc: "shards from the environment", yaml: addr + "queues: {q: {}}", env: map[string]string{"SLUICE_QUEUES_Q_SHARDS": "100"},
			want: []string{"SLUICE_QUEUES_Q_SHARDS: queues.q.shards: must be from 1 (one asynq queue, the default) to 64, got 100"}},
		{desc: "ambiguous environment variable", yaml: addr + "queues: {a-b: {}, a_b: {}}",
			env:  map[string]string{"SLUICE_QUEUES_A_B_PRIORITY": "2"},
			want: []string{"SLUICE_QUEUES_A_B_PRIORITY: would set each of queues.a-b.priority, queues.a_b.priority"}},
	} {
		t.Run(tt.desc, func(t *testing.T) {
			for k, v := range tt.env {
				t.Setenv(k, v)
			}
			f, err := Load(write(t, tt.yaml))
			var p *Problems
			if !errors.As(err, &p) {
				t.Fatalf("Load = %+v, %v; want *Problems", f, err)
			}
			if len(p.Errs) != len(tt.want) {
				t.Fatalf("got %d problems, want %d:\n%v", len(p.Errs), len(tt.want), err)
			}
			for i, want := range tt.want {
				if !strings.Contains(p.Errs[i].Error(), want) {
					t.Errorf("problem %d = %q, want it to contain %q", i, p.Errs[i], want)
				}
			}
		})
	}
}

func TestLoadMissingFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "nope.yaml")
	_, err := Load(path)
	var p *Problems
	if !errors.Is(err, fs.ErrNotExist) || errors.As(err, &p) || !strings.Contains(err.Error(), path) {
		t.Errorf("Load(missing) error = %v; want a not-exist error naming %s", err, path)
	}
}

func TestLoadEnvironment(t *testing.T) {
	const file = `
redis: {addr: 127.0.0.1:6379}
worker: {concurrency: 3, metrics_addr: 127.0.0.1:2112}
queues: {emails: {priority: 3}, reports: {drain: {limit: 5, period: 1s}}}
quotas: {example-api: {limit: 10, period: 1s}, api.example.com: {limit: 1, period: 1s}}
tasks: {'http:request': {quotas: [example-api]}}
`
	for _, tt := range []struct {
		desc  string
		yaml  string // default: file
		env   map[string]string
		check func(File) bool
	}{
		{desc: "redis.addr", env: map[string]string{"SLUICE_REDIS_ADDR": "redis:6379"},
			check: func(f File) bool { return f.Redis.Addr == "redis:6379" }},
		{desc: "worker.metrics_addr", env: map[string]string{"SLUICE_WORKER_METRICS_ADDR": "0.0.0.0:2112"},
			check: func(f File) bool { return f.Jobs.Worker.MetricsAddr == "0.0.0.0:2112" }},
		{desc: "worker.concurrency", env: map[string]string{"SLUICE_WORKER_CONCURRENCY": "42"},
			check: func(f File) bool { return f.Jobs.Worker.Concurrency == 42 }},
		{desc: "section absent from the file", yaml: "redis: {addr: 127.0.0.1:6379}",
			env: map[string]string{"SLUICE_WORKER_METRICS_ADDR": "0.0.0.0:2112", "SLUICE_WORKER_HOLD_MAX": "2s", "SLUICE_REDIS_TLS": "true", "SLUICE_HTTP_ALLOW": "a,b"},
			check: func(f File) bool {
				return f.Jobs.Worker == jobs.WorkerConfig{Concurrency: 10, MetricsAddr: "0.0.0.0:2112", HoldMax: 2 * time.Second, ReserveMax: time.Minute, Waiting: 10} &&
					f.Redis.TLS && reflect.DeepEqual(f.Jobs.HTTP.Allow, []string{"a", "b"})
			}},
		{desc: "redis.cluster list", env: map[string]string{"SLUICE_REDIS_CLUSTER": "h1:7000, h2:7001,,h3:7002"},
			check: func(f File) bool {
				return reflect.DeepEqual(f.Redis.Cluster, []string{"h1:7000", "h2:7001", "h3:7002"})
			}},
		{desc: "key absent from the file", env: map[string]string{"SLUICE_GATEWAY_BAN_AFTER": "5", "SLUICE_GATEWAY_BAN_WITHIN": "1m", "SLUICE_GATEWAY_BAN_FOR": "10m"},
			check: func(f File) bool {
				return f.Gateway.Ban == Ban{After: 5, Within: time.Minute, For: 10 * time.Minute, Max: 10 * time.Minute}
			}},
		{desc: "queue named in the file", env: map[string]string{"SLUICE_QUEUES_EMAILS_PRIORITY": "6", "SLUICE_QUEUES_REPORTS_DRAIN_LIMIT": "9"},
			check: func(f File) bool {
				return f.Jobs.Queues["emails"].Priority == 6 && f.Jobs.Queues["reports"].Drain.Limit == 9 && f.Jobs.Queues["reports"].Drain.Period == time.Second
			}},
		{desc: "drain the file does not set", env: map[string]string{"SLUICE_QUEUES_EMAILS_DRAIN_LIMIT": "4", "SLUICE_QUEUES_EMAILS_DRAIN_PERIOD": "1s"},
			check: func(f File) bool {
				d := f.Jobs.Queues["emails"].Drain
				return d != nil && d.Limit == 4 && d.Algorithm == "leaky_bucket"
			}},
		{desc: "quota and task names with punctuation", env: map[string]string{"SLUICE_QUOTAS_EXAMPLE_API_LIMIT": "20", "SLUICE_QUOTAS_API_EXAMPLE_COM_BURST": "3", "SLUICE_TASKS_HTTP_REQUEST_COST": "2"},
			check: func(f File) bool {
				return f.Jobs.Quotas["example-api"].Limit == 20 && f.Jobs.Quotas["api.example.com"].Burst == 3 && f.Jobs.Tasks["http:request"].Cost == 2
			}},
		{desc: "empty and unknown variables are ignored", env: map[string]string{"SLUICE_REDIS_ADDR": "", "SLUICE_NOTHING": "x", "SLUICE_QUEUES_BULK_PRIORITY": "2"},
			check: func(f File) bool { _, bulk := f.Jobs.Queues["bulk"]; return f.Redis.Addr == "127.0.0.1:6379" && !bulk }},
	} {
		t.Run(tt.desc, func(t *testing.T) {
			for k, v := range tt.env {
				t.Setenv(k, v)
			}
			content := file
			if tt.yaml != "" {
				content = tt.yaml
			}
			f, err := Load(write(t, content))
			if err != nil {
				t.Fatal(err)
			}
			if !tt.check(f) {
				t.Errorf("got %+v", f)
			}
		})
	}
}

// The config.yaml at the repository's root is the one users start from.
func TestDefaultConfigFile(t *testing.T) {
	f, err := Load(filepath.Join("..", "config.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	for _, q := range []string{"default", "emails", "reports"} {
		if _, ok := f.Jobs.Queues[q]; !ok {
			t.Errorf("config.yaml has no queue %q", q)
		}
	}
	if f.Jobs.Tasks["http:request"].Quotas[0] != "example-api" {
		t.Errorf("http:request draws on %v, want [example-api]", f.Jobs.Tasks["http:request"].Quotas)
	}
}

// TestExampleCRMQuota (issue 20.2): the worked example of the README's
// guide, 5 per second and 10,000 per day per token, loads, and its
// per-second quota is counted over 1s plus the default guard.
func TestExampleCRMQuota(t *testing.T) {
	f, err := Load(filepath.Join("..", "examples", "crm-quota", "config.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	cfg := f.Jobs.Defaults()
	if errs := cfg.Validate(); len(errs) > 0 {
		t.Fatal(errs)
	}
	if got := cfg.Quotas["crm-per-second"].Spec(); got.Period != 1075*time.Millisecond || got.Limit != 5 {
		t.Errorf("crm-per-second = %+v, want 5 per 1.075s", got)
	}
	if got := cfg.Quotas["crm-per-day"].Spec(); got.Period != 24*time.Hour || got.Limit != 10000 {
		t.Errorf("crm-per-day = %+v, want 10000 per 24h", got)
	}
}

func TestRedisClients(t *testing.T) {
	for _, tt := range []struct {
		desc        string
		redis       Redis
		wantCluster bool
		addrEnv     string // a live Redis to ping, if the test environment has one
	}{
		{desc: "plain", redis: Redis{Addr: "127.0.0.1:6379", DB: 2}, addrEnv: "SLUICE_TEST_REDIS_ADDR"},
		{desc: "plain with TLS", redis: Redis{Addr: "127.0.0.1:6379", TLS: true}},
		{desc: "cluster", redis: Redis{Addr: "ignored:1", Cluster: []string{"h1:7000"}}, wantCluster: true, addrEnv: "SLUICE_TEST_REDIS_CLUSTER"},
	} {
		t.Run(tt.desc, func(t *testing.T) {
			switch opt := tt.redis.AsynqOpt().(type) {
			case asynq.RedisClientOpt:
				if tt.wantCluster || opt.Addr != tt.redis.Addr || opt.DB != tt.redis.DB || (opt.TLSConfig != nil) != tt.redis.TLS {
					t.Errorf("AsynqOpt() = %+v", opt)
				}
			case clusterConnOpt:
				c, ok := opt.MakeRedisClient().(*redis.ClusterClient)
				if !tt.wantCluster || !ok || !reflect.DeepEqual(c.Options().Addrs, tt.redis.Cluster) {
					t.Errorf("AsynqOpt() = %+v, making a %T", opt, opt.MakeRedisClient())
				}
				if ok {
					c.Close()
				}
			default:
				t.Errorf("AsynqOpt() is a %T", opt)
			}
			client := tt.redis.Client()
			defer client.Close()
			if _, cluster := client.(*redis.ClusterClient); cluster != tt.wantCluster {
				t.Errorf("Client() is a %T", client)
			}
			live := os.Getenv(tt.addrEnv)
			if tt.addrEnv == "" || live == "" {
				return
			}
			r := tt.redis
			r.Addr, r.DB, r.Cluster = live, 0, nil
			if tt.wantCluster {
				r.Cluster = strings.Split(live, ",")
			}
			c := r.Client()
			defer c.Close()
			if err := c.Ping(context.Background()).Err(); err != nil {
				t.Errorf("Ping(%s) = %v", live, err)
			}
		})
	}
}

// TestProblemFields: each problem is a *Problem whose fields say where it
// was written: a line of the file (for a key the file leaves out, the line
// of the nearest key above it), or the variable that set the key.
func TestProblemFields(t *testing.T) {
	t.Setenv("SLUICE_WORKER_CONCURRENCY", "-2")
	path := write(t, "redis: {addr: 127.0.0.1:6379}\nqueues:\n  Emails:\n    drain:\n      limit: -3\n      period: 1s\ngateway:\n  ban: {after: 3, for: 1m}\n")
	_, err := Load(path)
	var p *Problems
	if !errors.As(err, &p) {
		t.Fatalf("Load = %v, want *Problems", err)
	}
	want := []Problem{
		{File: path, Env: "SLUICE_WORKER_CONCURRENCY", Path: "worker.concurrency", Msg: "must be >= 1, got -2"},
		{File: path, Line: 5, Path: "queues.Emails.drain.limit", Msg: "must be > 0, got -3"},
		{File: path, Line: 8, Path: "gateway.ban.within", Msg: "must be > 0 when gateway.ban.after is set, got 0s"},
	}
	if len(p.Errs) != len(want) {
		t.Fatalf("got %d problems, want %d:\n%v", len(p.Errs), len(want), err)
	}
	for i, w := range want {
		if got, ok := p.Errs[i].(*Problem); !ok || *got != w {
			t.Errorf("problem %d = %#v, want %#v", i, p.Errs[i], w)
		}
	}
}

// TestLoadRefusesHugeFile: a file over maxFileSize (a wrong path, say) is
// refused by its size, naming the path, before it is read whole; the
// watcher reads files the same way.
func TestLoadRefusesHugeFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "config.yaml")
	content := "redis: {addr: 127.0.0.1:6379}\n# " + strings.Repeat("x", maxFileSize) + "\n"
	if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	_, err := Load(path)
	if err == nil || !strings.Contains(err.Error(), path+" is over 16 MiB") {
		t.Fatalf("Load of a %d-byte file: %v, want it refused by its size, naming the path", len(content), err)
	}
}
