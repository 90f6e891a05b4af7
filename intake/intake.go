// Package intake is sluice's HTTP intake of tasks, as an http.Handler built
// from the config: POST /v1/tasks takes one task line (what one line of
// enqueue --file holds) and enqueues it, GET /healthz answers ok. With an
// admin token configured, it serves the admin API too (admin.go).
//
// A request meets, in order: bans (by address and API key), the API key
// (gateway.clients, or anonymous clients where the config allows them),
// the body read and checked with its own deadline, the limits of
// gateway.limits (all or nothing, 429 with Retry-After), and the client's
// rights to the task's type and queue. A client that keeps being refused
// is banned. Reload swaps the clients, types and queues of a live intake;
// its limits stay as New made them.
//
//	in, err := intake.New(f, rdb, asynq.NewClient(f.Redis.AsynqOpt()), intake.WithRegisterer(reg))
//	srv := &http.Server{Handler: in, ReadTimeout: intake.BodyTimeout + 5*time.Second}
package intake

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net"
	"net/http"
	"net/netip"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"github.com/hibiken/asynq"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/config"
	"github.com/sluicehq/sluice/jobs"
	"github.com/sluicehq/sluice/producer"
	"github.com/sluicehq/sluice/throttle"
	"github.com/sluicehq/sluice/throttle/httplimit"
)

const (
	// maxBody bounds a request body: a task is a type, a payload and
	// options. http:request bodies larger than this belong elsewhere.
	maxBody = 256 << 10
	// BodyTimeout is how long a request's body may take to arrive, once
	// the cheap checks (bans, API key) have passed; a server's ReadTimeout
	// should allow it.
	BodyTimeout = 5 * time.Second
	// APIKeyHeader holds a client's API key.
	APIKeyHeader = "X-API-Key"
)

// Intake is the HTTP intake: an http.Handler for POST /v1/tasks and
// GET /healthz. Make one with New.
type Intake struct {
	mux      *http.ServeMux
	rdb      redis.UniversalClient // the limits' Redis: the gateway's and the fleet's (admin.go)
	client   *asynq.Client
	limiter  *httplimit.Limiter
	log      *slog.Logger
	rules    atomic.Pointer[rules] // swapped whole when the config changes
	accepted *prometheus.CounterVec
	spread   producer.Spread // picks a sharded queue's shard for each task
}

// Option sets up an Intake in New.
type Option func(*options)

type options struct {
	reg prometheus.Registerer
	log *slog.Logger
}

// WithRegisterer registers the intake's metrics (requests answered by
// status code, and the limits' metrics) on reg; by default they go to a
// registry of their own, unseen.
func WithRegisterer(reg prometheus.Registerer) Option { return func(o *options) { o.reg = reg } }

// WithLogger logs refusals by Redis and the limits' failures to log;
// slog.Default() by default.
func WithLogger(log *slog.Logger) Option { return func(o *options) { o.log = log } }

// New returns the intake of f: its gateway's limits and bans kept in rdb,
// its tasks enqueued by client. It fails, naming the config key at fault,
// when the gateway's limits are wrong (config.Load has checked them). An
// intake whose gateway leaves it no clients (see Closed) answers every
// request 503: refuse to start one where that is a mistake.
func New(f config.File, rdb redis.UniversalClient, client *asynq.Client, opts ...Option) (*Intake, error) {
	o := options{reg: prometheus.NewRegistry(), log: slog.Default()}
	for _, opt := range opts {
		opt(&o)
	}
	limits, err := gatewayLimits(f.Gateway)
	if err != nil {
		return nil, err
	}
	limiter, err := httplimit.New(rdb, limits, httplimit.WithRegisterer(o.reg), httplimit.WithLogger(o.log),
		httplimit.WithKeyFunc(func(r *http.Request) string { return taskTypeOf(r.Context()) }))
	if err != nil {
		return nil, err
	}
	in := &Intake{rdb: rdb, client: client, limiter: limiter, log: o.log, accepted: prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "sluice_intake_requests_total",
		Help: "Task requests the intake answered, by status code.",
	}, []string{"code"})}
	if err := o.reg.Register(in.accepted); err != nil {
		return nil, fmt.Errorf("intake: registering its metrics: %w", err)
	}
	in.Reload(f)
	in.mux = http.NewServeMux()
	// The cheap checks first: a banned or unknown client costs no body read.
	in.mux.Handle("POST /v1/tasks", limiter.Bans(in.authenticate(in.readTask(limiter.Limits(http.HandlerFunc(in.enqueue))))))
	in.mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) { fmt.Fprintln(w, "ok") })
	in.adminRoutes()
	return in, nil
}

// ServeHTTP answers POST /v1/tasks and GET /healthz.
func (in *Intake) ServeHTTP(w http.ResponseWriter, r *http.Request) { in.mux.ServeHTTP(w, r) }

// Reload puts in force the clients, task types and queues of f (its
// gateway's limits stay as New made them) and returns Closed's verdict on
// f.Gateway: non-nil when the intake now refuses every request.
func (in *Intake) Reload(f config.File) error {
	r := newRules(f)
	in.rules.Store(r)
	return r.closed
}

// Closed says why an intake with gateway g, serving on g.Listen, must let
// no one in: off loopback, with no API key configured and anonymous clients
// not allowed on purpose. nil if it may serve. It is checked at start and
// after every reload, so that revoking the last key never opens the intake.
func Closed(g config.Gateway) error {
	if len(g.Clients) > 0 || g.AllowAnonymous || isLoopback(g.Listen) {
		return nil
	}
	return fmt.Errorf("gateway.listen %s is not a loopback address and gateway.clients names no API key: "+
		"anyone who reaches it could enqueue; add gateway.clients, or set gateway.allow_anonymous: true to serve anonymous clients on purpose", g.Listen)
}

// isLoopback reports whether a listen address host:port reaches only this
// machine: a loopback IP or localhost. An empty host listens everywhere.
func isLoopback(listen string) bool {
	host, _, err := net.SplitHostPort(listen)
	if err != nil {
		return false
	}
	if strings.EqualFold(host, "localhost") {
		return true
	}
	ip, err := netip.ParseAddr(host)
	return err == nil && ip.IsLoopback()
}

// gatewayLimits turns the config's gateway section into httplimit's.
func gatewayLimits(g config.Gateway) (httplimit.Config, error) {
	c := httplimit.Config{Ban: httplimit.Ban{After: g.Ban.After, Within: g.Ban.Within, For: g.Ban.For, Max: g.Ban.Max}, ClientHeader: APIKeyHeader}
	for _, cidr := range g.TrustedProxies {
		p, err := netip.ParsePrefix(cidr)
		if err != nil {
			return c, fmt.Errorf("gateway.trusted_proxies: %w", err)
		}
		c.TrustedProxies = append(c.TrustedProxies, p)
	}
	for _, l := range g.Limits {
		c.Limits = append(c.Limits, httplimit.Limit{
			Name: l.Name, Key: httplimit.KeyKind(l.Key), OnRedisError: l.OnRedisError,
			Spec: throttle.Spec{Algorithm: throttle.Algorithm(l.Algorithm), Limit: l.Limit, Period: l.Period, Burst: l.Burst, Windows: l.Windows},
		})
	}
	return c, nil
}

// A request's task, read before the limits so that a limit of key "type"
// can count by task type.
type taskKey struct{}

type readResult struct {
	task producer.Task
	err  error
}

// readTask reads and checks the body, with its own deadline, before the
// limits see the request.
func (in *Intake) readTask(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		// Not every connection can take a deadline (HTTP/2 streams, tests);
		// the server's ReadTimeout still holds there.
		_ = http.NewResponseController(w).SetReadDeadline(time.Now().Add(BodyTimeout))
		body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxBody))
		var res readResult
		switch {
		case err != nil:
			res.err = fmt.Errorf("reading the body: %w (at most %d bytes, within %v)", err, maxBody, BodyTimeout)
		default:
			res.task, res.err = producer.DecodeLine(body, producer.Defaults{Queue: "default", Payloads: in.rules.Load().payloads}, time.Now())
		}
		next.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), taskKey{}, res)))
	})
}

// taskTypeOf is the key of "type" limits: the task's type when it is one
// the intake takes, "invalid" otherwise, so a hostile client cannot make
// up keys.
func taskTypeOf(ctx context.Context) string {
	res, _ := ctx.Value(taskKey{}).(readResult)
	if res.err != nil {
		return "invalid"
	}
	return res.task.Asynq.Type()
}

// A request's known client, once authenticate let it in.
type clientKey struct{}

// authenticate lets in a request whose API key is a known client's, or
// one without a key when anonymous clients are allowed; others are
// answered 401, and the refusal counts toward a ban on their address. An
// intake whose config leaves it no clients (see Closed) answers every
// request 503: the client did nothing wrong, and a ban would outlast the fix.
func (in *Intake) authenticate(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		rules := in.rules.Load()
		if rules.closed != nil {
			w.Header().Set("Connection", "close")
			in.answer(w, http.StatusServiceUnavailable, map[string]string{
				"error": "this intake has no clients configured and refuses every request until its config names one " +
					"(gateway.clients) or allows anonymous clients (gateway.allow_anonymous)"})
			return
		}
		c, err := rules.client(r.Header.Get(APIKeyHeader))
		if err != nil {
			in.limiter.Refused(r)
			w.Header().Set("WWW-Authenticate", `APIKey header="`+APIKeyHeader+`"`)
			w.Header().Set("Connection", "close") // answer without reading the body first (see httplimit.Limiter.Bans)
			in.answer(w, http.StatusUnauthorized, map[string]string{"error": err.Error()})
			return
		}
		next.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), clientKey{}, c)))
	})
}

// enqueue enqueues the task of a request that passed the limits.
func (in *Intake) enqueue(w http.ResponseWriter, r *http.Request) {
	res, _ := r.Context().Value(taskKey{}).(readResult)
	if res.err != nil {
		answer := map[string]string{"error": res.err.Error()}
		var invalid *config.PayloadError
		if errors.As(res.err, &invalid) && len(invalid.Violations) > 0 {
			// Where the payload first breaks its schema, for programs.
			answer["path"] = invalid.Violations[0].Path
		}
		in.answer(w, http.StatusBadRequest, answer)
		return
	}
	t := res.task
	c, _ := r.Context().Value(clientKey{}).(*client)
	if code, err := in.rules.Load().admit(c, t); err != nil {
		in.answer(w, code, map[string]string{"error": err.Error()})
		return
	}
	// The client as its API key says, for limits and fair shares keyed by
	// client (a producer can spread a payload's field over many keys, not
	// its key).
	named := asynq.NewTaskWithHeaders(t.Asynq.Type(), t.Asynq.Payload(), map[string]string{jobs.HeaderClient: c.name})
	t = in.spread.Task(t, in.rules.Load().shards(t.Queue)) // a sharded queue's tasks over its shards
	info, err := in.client.EnqueueContext(r.Context(), named, t.Opts...)
	switch {
	case errors.Is(err, asynq.ErrTaskIDConflict):
		in.answer(w, http.StatusConflict, map[string]string{"error": "task id " + t.TaskID + " is taken in queue " + t.Queue, "id": t.TaskID, "queue": t.Queue})
	case errors.Is(err, asynq.ErrDuplicateTask):
		in.answer(w, http.StatusConflict, map[string]string{"error": "a task with the same type and payload is unique in queue " + t.Queue + " for now", "queue": t.Queue})
	case err != nil:
		w.Header().Set("Retry-After", "1")
		in.answer(w, http.StatusServiceUnavailable, map[string]string{"error": "could not enqueue: Redis failed; try again"})
		in.log.Error("enqueue failed", "err", err)
	default:
		in.answer(w, http.StatusAccepted, map[string]string{"id": info.ID, "queue": info.Queue})
	}
}

func (in *Intake) answer(w http.ResponseWriter, code int, body map[string]string) {
	in.accepted.WithLabelValues(fmt.Sprint(code)).Inc()
	writeJSON(w, code, body)
}

// answerJSON answers a request of the admin API (admin.go), not counted
// with the task requests.
func (in *Intake) answerJSON(w http.ResponseWriter, code int, body any) { writeJSON(w, code, body) }

func writeJSON(w http.ResponseWriter, code int, body any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	json.NewEncoder(w).Encode(body)
}

// rules are what the intake lets in, from the config: its known clients,
// the task types it takes and their payloads' schemas, the queues workers
// serve.
type rules struct {
	closed    error // non-nil: no one may come in, and why (see Closed)
	clients   []*client
	anonymous *client // nil: every request needs a known API key
	types     []string
	queues    []string
	payloads  producer.PayloadChecker // the task types and their schemas
	jobs      jobs.Config             // the fleet's limits, as the file has them (admin.go)
	shards    func(queue string) int  // a queue's shards (config.File.Shards)
	adminOn   bool                    // gateway.admin_token_hash is set
	admin     [32]byte                // its SHA-256
}

// client is one API key the intake knows and what it may do.
type client struct {
	name   string
	sum    [32]byte // the SHA-256 of its key
	types  []string
	queues []string
}

// newRules are the rules of f, for an intake serving on f.Gateway.Listen.
func newRules(f config.File) *rules {
	queues := slices.Sorted(maps.Keys(f.Jobs.Queues))
	g := f.Gateway
	r := &rules{closed: Closed(g), types: g.Types, queues: queues, payloads: f, jobs: f.Jobs, shards: f.Shards, adminOn: g.AdminTokenHash != ""}
	hex.Decode(r.admin[:], []byte(g.AdminTokenHash)) // 64 hex digits, if any: the config checked them
	for _, c := range g.Clients {
		k := &client{name: c.Name, types: c.Types, queues: c.Queues}
		if len(k.queues) == 0 {
			k.queues = queues
		}
		hex.Decode(k.sum[:], []byte(c.KeySHA256)) // 64 hex digits: the config checked them
		r.clients = append(r.clients, k)
	}
	if len(g.Clients) == 0 || g.AllowAnonymous {
		r.anonymous = &client{name: httplimit.Anonymous, types: g.Types, queues: queues}
	}
	return r
}

// client returns the client whose key apiKey is, or the anonymous client
// for no key when anonymous clients may come in; with no clients
// configured, every request is anonymous, whatever its key. The key's hash is
// compared with every client's in constant time, so how long the answer
// takes says nothing about how close a guess came.
func (r *rules) client(apiKey string) (*client, error) {
	if len(r.clients) == 0 {
		// No keys to check: a key only names a client for the limits.
		return r.anonymous, nil
	}
	if apiKey == "" {
		if r.anonymous == nil {
			return nil, errors.New("an API key is required: send it in the " + APIKeyHeader + " header")
		}
		return r.anonymous, nil
	}
	if len(apiKey) > 1024 {
		return nil, errors.New("unknown API key")
	}
	sum := sha256.Sum256([]byte(apiKey))
	var found *client
	for _, c := range r.clients {
		if subtle.ConstantTimeCompare(sum[:], c.sum[:]) == 1 {
			found = c
		}
	}
	if found == nil {
		return nil, errors.New("unknown API key")
	}
	return found, nil
}

// admit says whether c, the client authenticate let in, may enqueue t: 400 for what this intake takes from
// no one, 403 for what c may not do; each names the field.
func (r *rules) admit(c *client, t producer.Task) (int, error) {
	switch {
	case !slices.Contains(r.types, t.Asynq.Type()):
		return http.StatusBadRequest, fmt.Errorf("type: %q is not a type this intake takes (gateway.types: %s)", t.Asynq.Type(), strings.Join(r.types, ", "))
	case !slices.Contains(r.queues, t.Queue):
		return http.StatusBadRequest, fmt.Errorf("queue: %q is not under queues in the config, so no worker serves it (queues: %s)", t.Queue, strings.Join(r.queues, ", "))
	case t.Group != "":
		return http.StatusBadRequest, errors.New("options.group: workers run no group aggregator, so a grouped task would never run; leave it out")
	case !slices.Contains(c.types, t.Asynq.Type()):
		return http.StatusForbidden, fmt.Errorf("type: client %q may not enqueue %q (its types: %s)", c.name, t.Asynq.Type(), strings.Join(c.types, ", "))
	case !slices.Contains(c.queues, t.Queue):
		return http.StatusForbidden, fmt.Errorf("queue: client %q may not enqueue to %q (its queues: %s)", c.name, t.Queue, strings.Join(c.queues, ", "))
	}
	return 0, nil
}
