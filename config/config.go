// Package config turns config.yaml and SLUICE_* environment variables into
// the plain structs that sluice's commands, package worker and programs of
// your own run on: Load reads and checks a file, Watch reloads it when it
// changes. A program that runs its own asynq.Server takes its Redis
// connection from File.Redis and its gates from File.Jobs (see the
// asynqServer example). The file is decoded from the YAML's own nodes
// (go.yaml.in/yaml/v3), which give each key's line, and viper reads the
// environment; nothing outside this package and cmd/* knows either of them.
//
//	f, err := config.Load("config.yaml")
//	var problems *config.Problems
//	if errors.As(err, &problems) {
//		for _, p := range problems.Errs {
//			fmt.Fprintln(os.Stderr, p) // "config.yaml:14: queues.emails.drain.limit: must be > 0, got 0"
//		}
//		os.Exit(2)
//	}
//
// # Keys and names
//
// A key is its struct field's name in snake_case (MetricsAddr: metrics_addr);
// keys are case-insensitive (Worker: {Hold_Max: 2s} is worker.hold_max).
// Names of queues, quotas and task types are map keys too, and are kept as
// written, case included: asynq's names are case-sensitive, so queues Emails
// and emails are two queues. Dots, dashes and colons in names are kept
// (api.example.com, http:request).
//
// A key the structs do not have is a problem (worker.concurency: unknown
// key), and so is a key set twice in one mapping. YAML anchors, aliases
// and merge keys (<<: *defaults) work as YAML says. Durations need a unit
// (500ms, 1s, 5m); a bare number is a problem. A list may also be written
// as one comma-separated string, in the file as in the environment:
// "h1:6379, h2:6379" is [h1:6379, h2:6379]. Load reports every problem at
// once, each a *Problem that names its key and where it was written: the
// line of the file (for a key the file leaves out, the line of the nearest
// key above it that it sets), or the variable that set it.
//
// # Environment
//
// A non-empty environment variable SLUICE_<KEY> overrides a key, where <KEY>
// is the key path in capitals with every character other than a letter or a
// digit turned into "_": SLUICE_REDIS_ADDR, SLUICE_WORKER_METRICS_ADDR,
// SLUICE_GATEWAY_BAN_FOR, SLUICE_REDIS_CLUSTER=h1:6379,h2:6379. Every key of
// redis, worker, http and gateway except gateway.limits and gateway.clients
// has its variable, so a variable works whether or not the file sets the
// key; so does every key of each queue, quota and task type the file names:
// SLUICE_QUEUES_EMAILS_DRAIN_LIMIT, SLUICE_QUOTAS_EXAMPLE_API_LIMIT,
// SLUICE_TASKS_HTTP_REQUEST_COST. A queue, quota or task type the file does
// not name cannot be added from the environment. A variable that would set
// two keys (queues "a-b" and "a_b", or "Emails" and "emails", both give
// SLUICE_QUEUES_A_B_PRIORITY or SLUICE_QUEUES_EMAILS_PRIORITY) is a
// problem, not a guess. Empty variables and SLUICE_ variables that match no
// key are ignored.
//
// # Payload schemas
//
// tasks.<type>.schema names a JSON Schema file (2020-12 unless its $schema
// says otherwise) relative to the config file. Load compiles it, with the
// santhosh-tekuri/jsonschema library: a schema that is missing, larger than
// 1 MiB, not JSON or not a valid schema is a problem of tasks.<type>.schema.
// File.CheckPayload checks a payload against it, as enqueue and its intake
// do before anything is written; a violation is a *PayloadError that gives
// the JSON Pointer of each place the payload breaks the schema.
//
// # Redis
//
// Redis.Client and Redis.AsynqOpt connect as the redis section says, TLS
// included: the redis.tls_* files are read and checked by Load, and again
// each time a client is made. Their Redis Cluster clients reload the
// cluster's map whenever a node cannot be dialled, so that they find a
// promoted replica at once. Redis.Ping tells a refusal that comes from
// the config (a *RefusedError naming the key to change: a wrong password,
// a certificate the configured CA did not sign) from Redis being down.
//
// # Watching
//
// Watch runs a small fsnotify loop of its own and calls Load (so viper) for
// each change. It does not use viper's WatchConfig: that watcher cannot be
// stopped (it runs until the file is removed), rereads on every write event,
// mid-save included, and reloads one shared viper instance, where Load
// builds a fresh one per read.
package config

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
	"github.com/santhosh-tekuri/jsonschema/v6"
	"golang.org/x/crypto/bcrypt"

	"github.com/sluicehq/sluice/jobs"
	"github.com/sluicehq/sluice/throttle"
)

// File is everything config.yaml says. Its Jobs part is spelled at the top
// level of the file (worker, queues, quotas, tasks, http).
type File struct {
	Redis   Redis
	Jobs    jobs.Config `config:",squash"`
	Gateway Gateway

	// digest is the SHA-256 of the bytes Load read, so that Watch can
	// tell a change made before it started.
	digest [sha256.Size]byte
	// schemas are the compiled schemas of tasks.<type>.schema, by type.
	schemas map[string]*jsonschema.Schema
}

// Redis says how to reach Redis.
type Redis struct {
	Addr     string // host:port; required unless Cluster is set
	Username string
	Password string
	DB       int // database number; must be 0 with Cluster
	// TLS connects with TLS, verifying the server's certificate against the
	// system's CAs, or those of TLSCaFile.
	TLS bool
	// TLSCaFile is a PEM file of the CAs that sign the server's certificate
	// (a private CA, as managed Redis services have), in place of the
	// system's. Needs TLS.
	TLSCaFile string
	// TLSCertFile and TLSKeyFile are a PEM client certificate and its
	// private key, for a server that asks for one (tls-auth-clients).
	// Both or neither; they need TLS.
	TLSCertFile string
	TLSKeyFile  string
	// TLSServerName is the name the server's certificate must hold, when
	// it is not the host of Addr (or of each Cluster node, by default).
	// Needs TLS.
	TLSServerName string
	Cluster       []string // host:port of some Redis Cluster nodes; when set, Addr is ignored
}

// Gateway configures the HTTP intake (enqueue serve).
type Gateway struct {
	Listen         string   // host:port; default 127.0.0.1:8080
	TrustedProxies []string // CIDRs whose X-Forwarded-For is believed
	Limits         []GatewayLimit
	Ban            Ban
	// Types are the task types the intake accepts. Default: every built-in
	// type except http:request, which makes a worker call a URL.
	Types []string
	// Clients are the API keys the intake knows. With any, a request needs
	// one of them (unless AllowAnonymous).
	Clients []GatewayClient
	// AllowAnonymous lets requests without an API key in, with Types and
	// every configured queue. Without it, an intake that listens beyond
	// loopback must have Clients, or it does not start.
	AllowAnonymous bool
	// MetricsAddr serves the intake's Prometheus /metrics, apart from the
	// public listener; default 127.0.0.1:2113.
	MetricsAddr string
	// MaxConnections caps the connections the intake holds open at once;
	// default 256.
	MaxConnections int
	// AdminTokenHash is the SHA-256 of the admin token, 64 hex digits, as
	// a client's key_sha256: with it, the intake serves the admin API
	// (/v1/limits, /v1/tasks/{queue}/{id}) to requests that bear the
	// token; without it, those routes do not exist.
	AdminTokenHash string
}

// GatewayClient is one API key the intake accepts and what it may do.
type GatewayClient struct {
	Name      string   // unique; names the client in logs
	KeySHA256 string   // the SHA-256 of the key, 64 hex digits; never the key
	Types     []string // task types it may enqueue, of gateway.types; default gateway.types
	Queues    []string // queues it may enqueue to, of queues; default every configured queue
}

// GatewayLimit is one rate limit on the HTTP intake.
type GatewayLimit struct {
	Name         string // unique among the limits; names it in metrics
	Key          string // what is counted: global, client, ip or type (task type)
	Algorithm    string // default token_bucket
	Limit        int
	Period       time.Duration
	Burst        int
	Windows      int
	OnRedisError string // deny (default), allow or local
}

// Ban shuts out a client that keeps hitting the limits: After refusals
// within Within ban it for For; a client banned again is banned longer, up
// to Max.
type Ban struct {
	After  int // 0: no bans
	Within time.Duration
	For    time.Duration
	Max    time.Duration // default For
}

// Problem is one thing wrong with a config, where it was written: at a
// line of the file, or in a SLUICE_* variable. Its Error reads
// "config.yaml:14: queues.emails.drain.limit: must be > 0, got -3", or
// "SLUICE_QUEUES_EMAILS_DRAIN_LIMIT: queues.emails.drain.limit: must be > 0,
// got -3" for a variable.
type Problem struct {
	File string // the config file's path
	// Line is the line of Path in File, or of the nearest key above it
	// that the file sets (for a key it leaves out); 0 when the file sets
	// none of them, or when Env is set.
	Line int
	Env  string // the variable that set Path, or a key above it, if one did
	Path string // the key as config.yaml spells it; "" for the file as a whole
	Msg  string // what is wrong: "must be > 0, got -3"
}

func (p *Problem) Error() string {
	where := p.File
	switch {
	case p.Env != "":
		where = p.Env
	case p.Line > 0:
		where = fmt.Sprintf("%s:%d", p.File, p.Line)
	}
	if p.Path == "" {
		return where + ": " + p.Msg
	}
	return where + ": " + p.Path + ": " + p.Msg
}

// Problems is the error Load (and package worker) returns for a file or
// environment that is wrong: every problem at once, each a *Problem; those
// found reading the file, in the order of its lines, come first.
type Problems struct {
	Path string
	Errs []error
}

// Error lists every problem, one a line.
func (p *Problems) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "config: %s has %d problem(s):", p.Path, len(p.Errs))
	for _, err := range p.Errs {
		b.WriteString("\n\t")
		b.WriteString(err.Error())
	}
	return b.String()
}

// Unwrap returns the problems, for errors.Is and errors.As.
func (p *Problems) Unwrap() []error { return p.Errs }

// Load reads the config file at path, applies the SLUICE_* environment and
// the defaults, and validates the result. A missing or unreadable file is an
// error naming the path; anything wrong with the content or the environment
// is a *Problems listing every problem at once. On error the File is zero.
func Load(path string) (File, error) {
	data, err := readFile(path)
	if err != nil {
		return File{}, fmt.Errorf("config: %w", err)
	}
	return load(path, data)
}

// maxFileSize bounds a config file, so that a wrong path (a log, a disk
// image) is refused before it is read whole: the documented config.yaml
// is about 10 KB, and one with every limit's 1,000 key overrides stays
// far under it.
const maxFileSize = 16 << 20

// readFile reads the config file at path, refusing one larger than
// maxFileSize before it is read whole.
func readFile(path string) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	data, err := io.ReadAll(io.LimitReader(f, maxFileSize+1))
	if err != nil {
		return nil, err
	}
	if len(data) > maxFileSize {
		return nil, fmt.Errorf("%s is over %d MiB: a config file is at most that (is it the right file?)", path, maxFileSize>>20)
	}
	return data, nil
}

// Defaults returns f with every unset value at its default.
func (f File) Defaults() File {
	f.Jobs = f.Jobs.Defaults()
	f.Gateway = f.Gateway.Defaults()
	return f
}

// Validate returns one error per problem in f (after Defaults), each naming
// its key as config.yaml spells it, in the order of the file's sections.
func (f File) Validate() []error {
	return slices.Concat(f.Redis.Validate(), f.Jobs.Validate(), validateUI(f.Jobs.Worker.UI), f.Gateway.validate(f.TaskTypes()), f.Gateway.validateQueues(f.Jobs.Queues))
}

// validateUI checks worker.ui: writes only behind a login, and a password
// hash that bcrypt can read. Neither the hash nor a password is echoed.
func validateUI(ui jobs.WebUIConfig) []error {
	var p problems
	if ui.Writes && (ui.User == "" || ui.PasswordHash == "") {
		p.add("worker.ui.writes", "true needs worker.ui.user and worker.ui.password_hash: the UI can delete queues, so it must not without a login")
	}
	if ui.PasswordHash != "" {
		if _, err := bcrypt.Cost([]byte(ui.PasswordHash)); err != nil {
			p.add("worker.ui.password_hash", "must be a bcrypt hash like $2a$10$... (worker --hash-password makes one from a password on stdin), got %d characters that are not one", len(ui.PasswordHash))
		}
		if ui.User == "" {
			p.add("worker.ui.user", "must be set with worker.ui.password_hash: it is the login's user name")
		}
	}
	return p
}

// Validate returns one error per problem in r, each naming its key. It
// reads the TLS files and checks them (see TLSConfig).
func (r Redis) Validate() []error {
	var p problems
	if len(r.Cluster) > 0 {
		for i, addr := range r.Cluster {
			p.check(fmt.Sprintf("redis.cluster[%d]", i), hostPort(addr))
		}
		if r.DB != 0 {
			p.add("redis.db", "must be 0 with redis.cluster (a cluster has only database 0), got %d", r.DB)
		}
	} else if r.Addr == "" {
		p.add("redis.addr", "must be set to host:port, like 127.0.0.1:6379 (or set redis.cluster)")
	} else {
		p.check("redis.addr", hostPort(r.Addr))
	}
	if r.DB < 0 {
		p.add("redis.db", "must be >= 0, got %d", r.DB)
	}
	_, errs := r.tlsSetup()
	return append(p, errs...)
}

// Client returns a Redis Cluster client when r.Cluster is set, else a client
// of r.Addr; shorthand for ClientWith(nil). The caller closes it.
func (r Redis) Client() redis.UniversalClient { return r.ClientWith(nil) }

// ClientWith returns a client as Client does, with the options r gives
// changed first by tune, if not nil (a pool size, retries). A cluster
// client reloads the cluster's map as soon as a node cannot be reached
// (see reloadOnDialFailure), so that it finds a promoted replica at once.
func (r Redis) ClientWith(tune func(*redis.UniversalOptions)) redis.UniversalClient {
	opt := &redis.UniversalOptions{
		Addrs: []string{r.Addr}, Username: r.Username, Password: r.Password, DB: r.DB, TLSConfig: r.TLSConfig(),
	}
	if len(r.Cluster) > 0 {
		opt.Addrs = r.Cluster
	}
	if tune != nil {
		tune(opt)
	}
	if len(r.Cluster) > 0 {
		return newClusterClient(opt.Cluster())
	}
	return redis.NewClient(opt.Simple())
}

// AsynqOpt returns the asynq connection options for r: an
// asynq.RedisClientOpt, or with r.Cluster one whose client is Client's
// (asynq's own cluster client would call a dead master for up to a
// minute after its replica took over).
func (r Redis) AsynqOpt() asynq.RedisConnOpt {
	if len(r.Cluster) > 0 {
		return clusterConnOpt{r}
	}
	return asynq.RedisClientOpt{
		Addr: r.Addr, Username: r.Username, Password: r.Password, DB: r.DB, TLSConfig: r.TLSConfig(),
	}
}

// Defaults returns g with every unset value at its default.
func (g Gateway) Defaults() Gateway {
	if g.Listen == "" {
		g.Listen = "127.0.0.1:8080"
	}
	g.Limits = slices.Clone(g.Limits)
	for i, l := range g.Limits {
		if l.Algorithm == "" {
			g.Limits[i].Algorithm = string(throttle.TokenBucket)
		}
		if l.OnRedisError == "" {
			// Without Redis the intake cannot enqueue anyway.
			g.Limits[i].OnRedisError = jobs.OnRedisErrorDeny
		}
	}
	if g.Ban.Max == 0 {
		g.Ban.Max = g.Ban.For
	}
	if len(g.Types) == 0 {
		g.Types = nil
		for _, t := range jobs.Types() {
			if t.Name != jobs.TypeHTTPRequest {
				g.Types = append(g.Types, t.Name)
			}
		}
	}
	g.Clients = slices.Clone(g.Clients)
	for i, c := range g.Clients {
		g.Clients[i].KeySHA256 = strings.ToLower(c.KeySHA256)
		if len(c.Types) == 0 {
			g.Clients[i].Types = g.Types
		}
	}
	if g.MetricsAddr == "" {
		g.MetricsAddr = "127.0.0.1:2113"
	}
	if g.MaxConnections == 0 {
		g.MaxConnections = 256
	}
	return g
}

// Validate returns one error per problem in g (after Defaults), each naming
// its key. Its types must be built-in ones; File.Validate also takes the
// types named under tasks.
func (g Gateway) Validate() []error {
	return g.validate(File{}.TaskTypes())
}

// validate is Validate with the task types known.
// isSHA256 reports whether h is a SHA-256 as 64 hex digits.
func isSHA256(h string) bool {
	_, err := hex.DecodeString(h)
	return err == nil && len(h) == 64
}

func (g Gateway) validate(known []string) []error {
	var p problems
	p.check("gateway.listen", hostPort(g.Listen))
	for i, cidr := range g.TrustedProxies {
		if _, err := netip.ParsePrefix(cidr); err != nil {
			p.add(fmt.Sprintf("gateway.trusted_proxies[%d]", i), "must be a CIDR like 10.0.0.0/8 or 192.0.2.7/32, got %q", cidr)
		}
	}
	limitNames := uniqueNames{list: "gateway.limits", use: "metrics"}
	for i, l := range g.Limits {
		key := fmt.Sprintf("gateway.limits[%d]", i)
		limitNames.check(&p, i, l.Name)
		switch l.Key {
		case "global", "client", "ip", "type":
		default:
			p.add(key+".key", "must be global, client, ip or type, got %q", l.Key)
		}
		spec := throttle.Spec{Algorithm: throttle.Algorithm(l.Algorithm), Limit: l.Limit, Period: l.Period, Burst: l.Burst, Windows: l.Windows}
		p = append(p, validateLimit(key, spec, l.OnRedisError)...)
	}
	p.check("gateway.metrics_addr", hostPort(g.MetricsAddr))
	if g.MetricsAddr == g.Listen {
		p.add("gateway.metrics_addr", "must differ from gateway.listen (%s): metrics are not for the public listener", g.Listen)
	}
	if g.MaxConnections < 1 || g.MaxConnections > 100_000 {
		p.add("gateway.max_connections", "must be between 1 and 100000, got %d", g.MaxConnections)
	}
	for i, typ := range g.Types {
		if !slices.Contains(known, typ) {
			p.add(fmt.Sprintf("gateway.types[%d]", i), "%q is not a task type the intake knows; known: %s (a type of your own must be named under tasks)", typ, strings.Join(known, ", "))
		}
	}
	if g.AdminTokenHash != "" && !isSHA256(g.AdminTokenHash) { // not echoed, as key_sha256
		p.add("gateway.admin_token_hash", "must be the SHA-256 of the token as 64 hex digits (printf %%s TOKEN | sha256sum), got %d characters", len(g.AdminTokenHash))
	}
	clientNames, keys := uniqueNames{list: "gateway.clients", use: "logs"}, map[string]int{}
	for i, c := range g.Clients {
		key := fmt.Sprintf("gateway.clients[%d]", i)
		clientNames.check(&p, i, c.Name)
		if !isSHA256(c.KeySHA256) {
			// The value is a hash, but it is not echoed: it may be a key pasted by mistake.
			p.add(key+".key_sha256", "must be the SHA-256 of the key as 64 hex digits (printf %%s KEY | sha256sum), got %d characters", len(c.KeySHA256))
		} else if j, dup := keys[c.KeySHA256]; dup {
			p.add(key+".key_sha256", "is the same as gateway.clients[%d]'s; each client needs its own key", j)
		} else {
			keys[c.KeySHA256] = i
		}
		for j, typ := range c.Types {
			if !slices.Contains(g.Types, typ) {
				p.add(fmt.Sprintf("%s.types[%d]", key, j), "%q is not in gateway.types (%s); the intake accepts no other", typ, strings.Join(g.Types, ", "))
			}
		}
	}
	b := g.Ban
	if b.After < 0 {
		p.add("gateway.ban.after", "must be >= 0 (0: no bans), got %d", b.After)
	}
	if b.After > 0 {
		if b.Within <= 0 {
			p.add("gateway.ban.within", "must be > 0 when gateway.ban.after is set, got %v", b.Within)
		}
		if b.For <= 0 {
			p.add("gateway.ban.for", "must be > 0 when gateway.ban.after is set, got %v", b.For)
		}
		if b.Max < b.For {
			p.add("gateway.ban.max", "must be >= gateway.ban.for (%v), got %v", b.For, b.Max)
		}
	}
	return p
}

// uniqueNames checks the names of the items of a list: each set, and
// none taken by an earlier item.
type uniqueNames struct {
	list string // the list's key: gateway.limits
	use  string // what the name is for: "metrics"
	seen map[string]int
}

func (u *uniqueNames) check(p *problems, i int, name string) {
	key := fmt.Sprintf("%s[%d].name", u.list, i)
	if j, dup := u.seen[name]; dup {
		p.add(key, "%q is already the name of %s[%d]; names must be unique", name, u.list, j)
		return
	}
	if name == "" {
		p.add(key, "must be set: it names the item in %s", u.use)
		return
	}
	if u.seen == nil {
		u.seen = map[string]int{}
	}
	u.seen[name] = i
}

// Shards is how many shards queue has (queues.<q>.shards): 1 for a queue
// without, or one the config does not name. Producers spread a sharded
// queue's tasks over its shards with it (producer.Spread.Task,
// Loader.SpreadOver).
func (f File) Shards(queue string) int {
	return max(1, f.Jobs.Queues[queue].Shards)
}

// validateQueues checks that the clients' queues are configured queues.
func (g Gateway) validateQueues(queues map[string]jobs.QueueConfig) []error {
	var p problems
	for i, c := range g.Clients {
		for j, q := range c.Queues {
			if _, ok := queues[q]; !ok {
				p.add(fmt.Sprintf("gateway.clients[%d].queues[%d]", i, j), "%q is not under queues; the intake takes only configured queues", q)
			}
		}
	}
	return p
}

// validateLimit checks a limit the way jobs.Config.Validate checks its own.
func validateLimit(key string, spec throttle.Spec, onRedisError string) []error {
	var p problems
	switch onRedisError {
	case jobs.OnRedisErrorDeny, jobs.OnRedisErrorAllow, jobs.OnRedisErrorLocal:
	default:
		p.add(key+".on_redis_error", "must be deny, allow or local, got %q", onRedisError)
	}
	if _, err := throttle.NewLocal(spec); err != nil {
		var bad *throttle.SpecError
		if errors.As(err, &bad) {
			p.add(key+"."+strings.ToLower(bad.Field), "%s", bad.Problem)
		} else {
			p.add(key, "%v", err)
		}
	}
	return p
}

// hostPort checks that s is host:port with a numeric port.
func hostPort(s string) error {
	_, port, err := net.SplitHostPort(s)
	if n, perr := strconv.Atoi(port); err != nil || perr != nil || n < 1 || n > 65535 {
		return fmt.Errorf("must be host:port with a port from 1 to 65535, like 127.0.0.1:6379, got %q", s)
	}
	return nil
}

// problems collects problems of keys, as jobs.Config.Validate does.
type problems []error

func (p *problems) add(key, format string, args ...any) {
	*p = append(*p, &jobs.ConfigProblem{Key: key, Problem: fmt.Sprintf(format, args...)})
}

func (p *problems) check(key string, err error) {
	if err != nil {
		p.add(key, "%v", err)
	}
}
