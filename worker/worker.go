// Package worker is a sluice worker for your own task handlers: everything
// the sluice `worker` command is, as a library. New reads the config file
// (and its SLUICE_* overrides); Handle and HandleFunc register handlers as
// on an asynq.ServeMux; Run serves until its context ends. Every task goes
// through the gates of its queue and type (drain rate, quotas, concurrency)
// before its handler runs, and a task that must wait is given its turn,
// never failed or archived for waiting.
//
//	w, err := worker.New("config.yaml")
//	if err != nil {
//		fmt.Fprintln(os.Stderr, err) // every config problem, one a line, by key
//		os.Exit(2)
//	}
//	w.HandleFunc("email:send", sendEmail)
//	err = w.Run(ctx) // until ctx ends; then running tasks finish
//
// While it runs, a Worker reloads the config file when it changes (rates,
// quotas and limits are in force within well under 2 s; queues and the
// worker section need a restart), serves Prometheus metrics at /metrics,
// the asynqmon web UI at /ui/ (read-only unless worker.ui.writes, and then
// behind a login) and /healthz on worker.metrics_addr, and listens for the
// upstream signal: a handler that returns a *jobs.UpstreamBusyError (an API
// answered 429 or 503) blocks its type's quotas for the whole fleet.
//
// The built-in task types (demo:noop, demo:sleep, http:request) are not
// registered unless asked for: jobs.Register(w, allow) registers them the
// way the sluice worker command does.
//
// For a program that builds its own asynq.Server, package
// github.com/sluicehq/sluice/config loads the config, and jobs.Scheduler
// gives the middleware and the asynq.Config; see that package's example.
package worker

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/hibiken/asynq"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/config"
	"github.com/sluicehq/sluice/jobs"
)

// Worker is one sluice worker process's work: its config, its handlers and,
// once Run is called, its asynq server, gates, metrics and web UI. Make one
// with New; register handlers before Run.
type Worker struct {
	path string
	file config.File
	opts options
	mux  *asynq.ServeMux
	// patterns are the task types (or prefixes) handled, for
	// jobs.CheckHandled.
	patterns []string

	mu      sync.Mutex
	started bool
}

// Option configures a Worker.
type Option func(*options)

type options struct {
	log             *slog.Logger
	registry        *prometheus.Registry
	shutdownTimeout time.Duration
}

// WithLogger sets where the worker logs; the default is slog.Default().
func WithLogger(log *slog.Logger) Option {
	return func(o *options) { o.log = log }
}

// WithRegistry serves reg's metrics, with sluice's added to it, at
// /metrics, so that a program's own metrics are scraped with the worker's.
// The default is a new registry with the Go and process collectors.
func WithRegistry(reg *prometheus.Registry) Option {
	return func(o *options) { o.registry = reg }
}

// WithShutdownTimeout sets how long Run waits for running tasks once its
// context ends; tasks still running then are cancelled and come back later
// (asynq is at-least-once). The default is 10s; it must be > 0.
func WithShutdownTimeout(d time.Duration) Option {
	return func(o *options) { o.shutdownTimeout = d }
}

// New reads the config file at configPath with its SLUICE_* environment
// overrides (see package config) and returns a Worker for it. A config with
// problems returns a *config.Problems that lists every problem by key and
// line, as "config.yaml:14: queues.emails.drain.limit: must be > 0, got 0"
// (or by variable: "SLUICE_QUEUES_EMAILS_DRAIN_LIMIT: queues..."); a missing or unreadable
// file returns an error naming it. New connects to nothing: Run does.
func New(configPath string, opts ...Option) (*Worker, error) {
	o := options{log: slog.Default(), shutdownTimeout: 10 * time.Second}
	for _, opt := range opts {
		opt(&o)
	}
	if o.log == nil {
		return nil, errors.New("worker: WithLogger: the logger must not be nil")
	}
	if o.shutdownTimeout <= 0 {
		return nil, fmt.Errorf("worker: WithShutdownTimeout: must be > 0, got %v", o.shutdownTimeout)
	}
	if o.registry == nil {
		o.registry = prometheus.NewRegistry()
		o.registry.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	}
	file, err := config.Load(configPath)
	if err != nil {
		return nil, err
	}
	return &Worker{path: configPath, file: file, opts: o, mux: asynq.NewServeMux()}, nil
}

// Config is the config the worker was made with, as New read it (later
// changes to the file are applied to the gates by Run, not shown here).
func (w *Worker) Config() config.File { return w.file }

// Handle registers handler for the tasks whose type pattern names, as
// asynq.ServeMux.Handle does (the longest matching prefix wins). Register
// every handler before Run.
func (w *Worker) Handle(pattern string, handler asynq.Handler) {
	w.mux.Handle(pattern, handler)
	w.patterns = append(w.patterns, pattern)
}

// HandleFunc registers handler for the tasks whose type pattern names; it
// is shorthand for Handle(pattern, asynq.HandlerFunc(handler)).
func (w *Worker) HandleFunc(pattern string, handler func(context.Context, *asynq.Task) error) {
	w.Handle(pattern, asynq.HandlerFunc(handler))
}

// Run connects to Redis, serves the configured queues through the gates
// and the metrics and web UI, and reloads the config file when it
// changes, until ctx ends. It then stops taking tasks, waits for running
// ones (see WithShutdownTimeout) and returns nil. It returns an error if
// the worker cannot start (the metrics address is taken, Redis refuses
// the config's login or TLS setup: a *config.RefusedError; a task type a
// handler takes has no tasks: entry while one near its name has no
// handler, a typo: a *config.Problems, see jobs.CheckHandled) or if Run
// was called before. A reload with such a typo is refused and logged.
func (w *Worker) Run(ctx context.Context) error {
	w.mu.Lock()
	started := w.started
	w.started = true
	w.mu.Unlock()
	if started {
		return errors.New("worker: Run was called before; a Worker runs once")
	}
	log := w.opts.log
	if err := w.checkHandled(w.file.Jobs); err != nil {
		return err
	}
	rdb := w.file.Redis.Client()
	defer rdb.Close()
	// asynq's own client, with keepEnds (asynq closes no client it is
	// given) and jobs.EmptyPolls (an idle queue's polls run no script).
	asynqRDB := w.file.Redis.Client()
	defer asynqRDB.Close()
	asynqRDB.AddHook(keepEnds{})
	asynqRDB.AddHook(&jobs.EmptyPolls{})
	if err := checkRedis(ctx, w.file.Redis, rdb, log); err != nil {
		return fmt.Errorf("worker: %w", err)
	}
	redisOpt := w.file.Redis.AsynqOpt()
	sched, err := jobs.NewScheduler(rdb, redisOpt, w.file.Jobs, jobs.NewMetrics(w.opts.registry), log)
	if err != nil { // config.Load checked the config: this is not expected
		return fmt.Errorf("worker: %w", err)
	}
	defer sched.Close()
	w.mux.Use(sched.Middleware)
	cfg := sched.AsynqConfig()
	cfg.ShutdownTimeout = w.opts.shutdownTimeout
	srv := asynq.NewServerFromRedisClient(asynqRDB, cfg)

	sizes := newQueueSizes(rdb, w.file.Jobs, log)
	if err := w.opts.registry.Register(sizes); err != nil {
		return fmt.Errorf("worker: %w", err)
	}
	defer w.opts.registry.Unregister(sizes)
	limits := newLimitsPage(rdb, redisOpt, w.opts.registry, w.file.Jobs, log)
	webAddr, stopWeb, err := serveMetrics(sched.Config().Worker, w.opts.registry, redisOpt, limits, log)
	if err != nil {
		return fmt.Errorf("worker: metrics server on worker.metrics_addr: %w", err)
	}
	defer stopWeb()

	// The fleet's services and the watcher outlive ctx until the running
	// tasks are done: a task still waiting for its turn needs them. They
	// have all stopped, and no config change is being applied, before the
	// deferred closes above close their clients.
	background, stopBackground := context.WithCancel(context.WithoutCancel(ctx))
	var wg sync.WaitGroup
	var applying sync.Mutex // held while a change is applied
	stopped := false        // under applying: no change is applied any more
	defer func() {
		stopBackground()
		applying.Lock()
		stopped = true
		applying.Unlock()
		wg.Wait()
	}()
	wg.Go(func() { sched.Run(background) })
	// config.Watch's goroutine ends soon after background but is not
	// awaited: the flag keeps a change it reports late from being applied.
	config.Watch(background, w.path, w.file, func(f config.File) {
		applying.Lock()
		defer applying.Unlock()
		if stopped {
			return
		}
		if err := w.checkHandled(f.Jobs); err != nil {
			log.Error("config change refused; the last good config stays in force", "err", err)
			return
		}
		if err := sched.Apply(f.Jobs); err != nil {
			log.Error("config change refused; the last good config stays in force", "err", err)
			return
		}
		limits.file.Store(&f.Jobs)
		sizes.setQueues(f.Jobs)
		log.Info("config change in force", "path", w.path)
	}, func(err error) {
		log.Error("config change refused; the last good config stays in force", "err", err)
	})

	warm, cancelWarm := context.WithTimeout(ctx, 5*time.Second)
	if err := sched.Warm(warm); err != nil {
		log.Warn("cannot ready the gates before the first task; the first tasks may run a little late", "err", err)
	}
	cancelWarm()
	if err := srv.Start(w.mux); err != nil {
		return fmt.Errorf("worker: %w", err)
	}
	log.Info("worker running", "queues", cfg.Queues, "concurrency", cfg.Concurrency, "metrics", webAddr)
	<-ctx.Done()
	log.Info("stopping: waiting for running tasks", "timeout", w.opts.shutdownTimeout)
	srv.Shutdown()
	return nil
}

// checkHandled logs what jobs.CheckHandled finds in cfg for the worker's
// handlers, and refuses a config with a typo in a task type (a
// *config.Problems): a handled type would run without the limits meant
// for it, and only a look at the log would tell. The rest is logged, not
// refused: a fleet may split its task types over programs that share one
// config.
func (w *Worker) checkHandled(cfg jobs.Config) error {
	var typos []error
	for _, p := range jobs.CheckHandled(cfg, w.patterns) {
		if p.Typo {
			typos = append(typos, &config.Problem{File: w.path, Path: p.Key, Msg: p.Problem})
			continue
		}
		w.opts.log.Warn("a task type of the config is not handled here", "key", p.Key, "problem", p.Problem)
	}
	if len(typos) > 0 {
		return &config.Problems{Path: w.path, Errs: typos}
	}
	return nil
}

// checkRedis fails when Redis refuses the worker for a reason in the
// config (a wrong password or CA): asynq would try again forever, ten
// error lines a second. Redis that is down or starting is waited for, as
// asynq does, since it may come back.
func checkRedis(ctx context.Context, r config.Redis, rdb redis.UniversalClient, log *slog.Logger) error {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	err := r.Ping(ctx, rdb)
	var refused *config.RefusedError
	if errors.As(err, &refused) {
		return err
	}
	if err != nil {
		log.Warn("Redis does not answer yet; the worker starts and keeps trying", "err", err)
	}
	return nil
}

// serveMetrics serves Prometheus metrics on /metrics, asynqmon's web UI on
// /ui/ and the limits page on /ui/limits (see webUI) and /healthz at cfg.MetricsAddr, until stop is called:
// stop shuts the server down (waiting up to 5s for requests under way,
// and for its serving goroutine), then closes the web UI's connections.
func serveMetrics(cfg jobs.WorkerConfig, reg *prometheus.Registry, redisOpt asynq.RedisConnOpt, limits *limitsPage, log *slog.Logger) (addr string, stop func(), err error) {
	ln, err := net.Listen("tcp", cfg.MetricsAddr)
	if err != nil {
		limits.close()
		return "", nil, err
	}
	ui, closeUI := webUI(cfg.UI, redisOpt, limits)
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	mux.Handle("/ui/", ui)
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) { fmt.Fprintln(w, "ok") })
	srv := &http.Server{Addr: ln.Addr().String(), Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	served := make(chan struct{})
	go func() {
		defer close(served)
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Error("metrics server stopped", "err", err)
		}
	}()
	return srv.Addr, func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		srv.Shutdown(ctx)
		<-served
		closeUI()
	}, nil
}
