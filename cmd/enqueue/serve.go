package main

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
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/spf13/cobra"
	"golang.org/x/net/netutil"

	"github.com/sluicehq/sluice/config"
	"github.com/sluicehq/sluice/jobs"
	"github.com/sluicehq/sluice/throttle"
	"github.com/sluicehq/sluice/throttle/httplimit"
)

const (
	// maxBody bounds a request body: a task is a type, a payload and
	// options. http:request bodies larger than this belong elsewhere.
	maxBody = 256 << 10
	// bodyTimeout is how long the body may take to arrive, once the cheap
	// checks (bans, API key) have passed.
	bodyTimeout = 5 * time.Second
	// apiKeyHeader holds a client's API key.
	apiKeyHeader = "X-API-Key"
)

func newServeCommand(a *app) *cobra.Command {
	var listen string
	cmd := &cobra.Command{
		Use:   "serve [--listen HOST:PORT]",
		Short: "Serve the HTTP intake: POST /v1/tasks, rate-limited per client, per IP and overall",
		Long: `Serve an HTTP intake for tasks until SIGINT or SIGTERM.

  POST /v1/tasks  {"type": "...", "payload": {...}, "queue": "...", "options": {...}}
                  202 {"id": ..., "queue": ...}; 400 bad input; 401 missing or
                  unknown API key (X-API-Key); 403 a type or queue the client
                  may not use; 409 task id taken; 429 over a limit or banned
                  (Retry-After); 503 Redis failed, or no clients configured
  GET  /healthz   200 ok

Prometheus /metrics is served apart, on gateway.metrics_addr (loopback by
default). The body is what one line of --file holds, for a task type of
gateway.types and a queue under queues. Bans are checked, then the API key
(gateway.clients), then the body is read, then the limits of gateway.limits
are checked together, all or nothing; a client that keeps being refused is
banned (gateway.ban). An intake that listens beyond loopback needs
gateway.clients, or gateway.allow_anonymous: true: it does not start without
them, and a live change that removes its last client leaves it answering
every request 503 until the config names one again.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			return a.serve(cmd, listen)
		},
	}
	cmd.Flags().StringVar(&listen, "listen", "", "address to serve on (default gateway.listen)")
	return cmd
}

func (a *app) serve(cmd *cobra.Command, listen string) error {
	f, err := a.loadConfig()
	if err != nil {
		return err
	}
	if listen == "" {
		listen = f.Gateway.Listen
	}
	f.Gateway.Listen = listen
	if err := noClients(f.Gateway); err != nil {
		return badInput(fmt.Errorf("serve: %w", err))
	}
	limits, err := gatewayLimits(f.Gateway)
	if err != nil {
		return badInput(err)
	}
	log := slog.New(slog.NewTextHandler(cmd.ErrOrStderr(), nil))
	rdb := f.Redis.Client()
	defer rdb.Close()
	if err := checkLogin(cmd.Context(), f.Redis, rdb); err != nil {
		return err
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	limiter, err := httplimit.New(rdb, limits, httplimit.WithRegisterer(reg), httplimit.WithLogger(log),
		httplimit.WithKeyFunc(func(r *http.Request) string { return taskTypeOf(r.Context()) }))
	if err != nil {
		return badInput(err)
	}
	client := asynq.NewClient(f.Redis.AsynqOpt())
	defer client.Close()
	in := &intake{client: client, limiter: limiter, log: log, accepted: prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "sluice_intake_requests_total",
		Help: "Task requests the intake answered, by status code.",
	}, []string{"code"})}
	in.rules.Store(newRules(f))
	reg.MustRegister(in.accepted)

	mux := http.NewServeMux()
	// The cheap checks first: a banned or unknown client costs no body read.
	mux.Handle("POST /v1/tasks", limiter.Bans(in.authenticate(in.readTask(limiter.Limits(in)))))
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) { fmt.Fprintln(w, "ok") })
	metricsMux := http.NewServeMux()
	metricsMux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))

	ln, err := net.Listen("tcp", listen)
	if err != nil {
		return fmt.Errorf("serve: %w", err)
	}
	metricsLn, err := net.Listen("tcp", f.Gateway.MetricsAddr)
	if err != nil {
		ln.Close()
		return fmt.Errorf("serve: gateway.metrics_addr: %w", err)
	}
	srv := &http.Server{
		Handler:           mux,
		ReadHeaderTimeout: 5 * time.Second,
		ReadTimeout:       bodyTimeout + 5*time.Second, // the body's own deadline is set once the checks pass
		WriteTimeout:      15 * time.Second,
		IdleTimeout:       60 * time.Second,
		MaxHeaderBytes:    32 << 10,
	}
	metricsSrv := &http.Server{Handler: metricsMux, ReadHeaderTimeout: 5 * time.Second, WriteTimeout: 15 * time.Second}
	ctx := cmd.Context()
	go func() {
		if err := metricsSrv.Serve(metricsLn); !errors.Is(err, http.ErrServerClosed) {
			log.Error("metrics server stopped", "err", err)
		}
	}()
	go func() {
		<-ctx.Done()
		shutdown, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		defer cancel()
		srv.Shutdown(shutdown)
		metricsSrv.Shutdown(shutdown)
	}()
	config.Watch(ctx, a.configPath, f, func(f config.File) {
		f.Gateway.Listen = listen // the listener is bound: another address needs a restart
		r := newRules(f)
		in.rules.Store(r)
		if r.closed != nil {
			log.Error("config change in force: the intake has no clients configured and refuses every request (503)", "clients", 0, "err", r.closed)
			return
		}
		log.Info("config change in force: gateway.clients, gateway.types and the queues", "clients", len(f.Gateway.Clients))
	}, func(err error) {
		log.Error("config change refused; the last good clients stay in force", "err", err)
	})
	log.Info("intake serving", "addr", ln.Addr().String(), "metrics", metricsLn.Addr().String(),
		"limits", len(limits.Limits), "clients", len(f.Gateway.Clients), "max_connections", f.Gateway.MaxConnections)
	fmt.Fprintf(cmd.OutOrStdout(), "serving on http://%s\n", ln.Addr())
	if err := srv.Serve(netutil.LimitListener(ln, f.Gateway.MaxConnections)); !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

// noClients says why an intake with gateway g, serving on g.Listen, must let
// no one in: off loopback, with no API key configured and anonymous clients
// not allowed on purpose. nil if it may serve. It is checked at start and
// after every reload, so that revoking the last key never opens the intake.
func noClients(g config.Gateway) error {
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
	c := httplimit.Config{Ban: httplimit.Ban{After: g.Ban.After, Within: g.Ban.Within, For: g.Ban.For, Max: g.Ban.Max}, ClientHeader: apiKeyHeader}
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
	task task
	err  error
}

// readTask reads and checks the body, with its own deadline, before the
// limits see the request.
func (in *intake) readTask(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		// Not every connection can take a deadline (HTTP/2 streams, tests);
		// the server's ReadTimeout still holds there.
		_ = http.NewResponseController(w).SetReadDeadline(time.Now().Add(bodyTimeout))
		body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxBody))
		var res readResult
		switch {
		case err != nil:
			res.err = fmt.Errorf("reading the body: %w (at most %d bytes, within %v)", err, maxBody, bodyTimeout)
		default:
			res.task, res.err = decodeLine(body, lineDefaults{queue: "default", payloads: in.rules.Load().payloads}, time.Now())
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
	return res.task.task.Type()
}

// intake enqueues the task of a request that passed the limits.
type intake struct {
	client   *asynq.Client
	limiter  *httplimit.Limiter
	log      *slog.Logger
	rules    atomic.Pointer[rules] // swapped whole when the config changes
	accepted *prometheus.CounterVec
}

// A request's known client, once authenticate let it in.
type clientKey struct{}

// authenticate lets in a request whose API key is a known client's, or
// one without a key when anonymous clients are allowed; others are
// answered 401, and the refusal counts toward a ban on their address. An
// intake whose config leaves it no clients (see noClients) answers every
// request 503: the client did nothing wrong, and a ban would outlast the fix.
func (in *intake) authenticate(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		rules := in.rules.Load()
		if rules.closed != nil {
			w.Header().Set("Connection", "close")
			in.answer(w, http.StatusServiceUnavailable, map[string]string{
				"error": "this intake has no clients configured and refuses every request until its config names one " +
					"(gateway.clients) or allows anonymous clients (gateway.allow_anonymous)"})
			return
		}
		c, err := rules.client(r.Header.Get(apiKeyHeader))
		if err != nil {
			in.limiter.Refused(r)
			w.Header().Set("WWW-Authenticate", `APIKey header="`+apiKeyHeader+`"`)
			w.Header().Set("Connection", "close") // answer without reading the body first (see httplimit.Limiter.Bans)
			in.answer(w, http.StatusUnauthorized, map[string]string{"error": err.Error()})
			return
		}
		next.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), clientKey{}, c)))
	})
}

func (in *intake) ServeHTTP(w http.ResponseWriter, r *http.Request) {
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
	named := asynq.NewTaskWithHeaders(t.task.Type(), t.task.Payload(), map[string]string{jobs.HeaderClient: c.name})
	info, err := in.client.EnqueueContext(r.Context(), named, t.opts...)
	switch {
	case errors.Is(err, asynq.ErrTaskIDConflict):
		in.answer(w, http.StatusConflict, map[string]string{"error": "task id " + t.taskID + " is taken in queue " + t.queue, "id": t.taskID, "queue": t.queue})
	case errors.Is(err, asynq.ErrDuplicateTask):
		in.answer(w, http.StatusConflict, map[string]string{"error": "a task with the same type and payload is unique in queue " + t.queue + " for now", "queue": t.queue})
	case err != nil:
		w.Header().Set("Retry-After", "1")
		in.answer(w, http.StatusServiceUnavailable, map[string]string{"error": "could not enqueue: Redis failed; try again"})
		in.log.Error("enqueue failed", "err", err)
	default:
		in.answer(w, http.StatusAccepted, map[string]string{"id": info.ID, "queue": info.Queue})
	}
}

func (in *intake) answer(w http.ResponseWriter, code int, body map[string]string) {
	in.accepted.WithLabelValues(fmt.Sprint(code)).Inc()
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	json.NewEncoder(w).Encode(body)
}

// rules are what the intake lets in, from the config: its known clients,
// the task types it takes and their payloads' schemas, the queues workers
// serve.
type rules struct {
	closed    error // non-nil: no one may come in, and why (see noClients)
	clients   []*client
	anonymous *client // nil: every request needs a known API key
	types     []string
	queues    []string
	payloads  payloadChecker // the task types and their schemas
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
	r := &rules{closed: noClients(g), types: g.Types, queues: queues, payloads: f}
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
			return nil, errors.New("an API key is required: send it in the " + apiKeyHeader + " header")
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
func (r *rules) admit(c *client, t task) (int, error) {
	switch {
	case !slices.Contains(r.types, t.task.Type()):
		return http.StatusBadRequest, fmt.Errorf("type: %q is not a type this intake takes (gateway.types: %s)", t.task.Type(), strings.Join(r.types, ", "))
	case !slices.Contains(r.queues, t.queue):
		return http.StatusBadRequest, fmt.Errorf("queue: %q is not under queues in the config, so no worker serves it (queues: %s)", t.queue, strings.Join(r.queues, ", "))
	case t.group != "":
		return http.StatusBadRequest, errors.New("options.group: workers run no group aggregator, so a grouped task would never run; leave it out")
	case !slices.Contains(c.types, t.task.Type()):
		return http.StatusForbidden, fmt.Errorf("type: client %q may not enqueue %q (its types: %s)", c.name, t.task.Type(), strings.Join(c.types, ", "))
	case !slices.Contains(c.queues, t.queue):
		return http.StatusForbidden, fmt.Errorf("queue: client %q may not enqueue to %q (its queues: %s)", c.name, t.queue, strings.Join(c.queues, ", "))
	}
	return 0, nil
}
