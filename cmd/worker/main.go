// Command worker runs one sluice worker: it consumes the queues of
// config.yaml through asynq, puts every task through its gates (drain,
// quotas, concurrency) and runs its handler, until SIGINT or SIGTERM.
//
//	worker --config config.yaml [--embedded-redis] [--demo N]
//	worker --hash-password < password.txt     prints a bcrypt hash for worker.ui.password_hash
//
// Exit codes: 0 after a graceful stop, 1 when it cannot run, 2 when the
// config has problems (one line per problem, naming its key).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/hibiken/asynq"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/sluicehq/sluice/config"
	"github.com/sluicehq/sluice/jobs"
)

func main() {
	os.Exit(run())
}

func run() int {
	path := flag.String("config", "config.yaml", "the config file")
	embedded := flag.Bool("embedded-redis", false, "serve an in-process, non-durable Redis on redis.addr (a try-out, not a store)")
	demo := flag.Int("demo", 0, "enqueue this many demo:noop tasks into each queue and show their progress")
	hash := flag.Bool("hash-password", false, "read a password from stdin, print its bcrypt hash for worker.ui.password_hash, and exit")
	flag.Parse()
	if *hash {
		input, err := io.ReadAll(io.LimitReader(os.Stdin, 1<<10))
		if err == nil {
			var h string
			if h, err = hashPassword(string(input)); err == nil {
				fmt.Println(h)
				return 0
			}
		}
		fmt.Fprintf(os.Stderr, "worker: --hash-password: %v\n", err)
		return 2
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: logLevel()}))

	file, err := config.Load(*path)
	if err != nil {
		var problems *config.Problems
		if errors.As(err, &problems) {
			for _, p := range problems.Errs {
				fmt.Fprintf(os.Stderr, "worker: %s: %v\n", *path, p)
			}
			return 2
		}
		fmt.Fprintf(os.Stderr, "worker: %v\n", err)
		return 2
	}

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()

	if *embedded {
		closeRedis, err := startEmbeddedRedis(ctx, file.Redis.Addr, log)
		if err != nil {
			fmt.Fprintf(os.Stderr, "worker: embedded redis: %v\n", err)
			return 1
		}
		defer closeRedis()
	}

	rdb := file.Redis.Client()
	defer rdb.Close()
	redisOpt := file.Redis.AsynqOpt()
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	metrics := jobs.NewMetrics(reg)
	sched, err := jobs.NewScheduler(rdb, redisOpt, file.Jobs, metrics, log)
	if err != nil {
		fmt.Fprintf(os.Stderr, "worker: %v\n", err)
		return 2
	}
	defer sched.Close()

	mux := asynq.NewServeMux()
	mux.Use(sched.Middleware)
	allow, err := jobs.ParseAllowList(file.Jobs.HTTP.Allow)
	if err != nil { // config.Load checked it
		fmt.Fprintf(os.Stderr, "worker: %v\n", err)
		return 2
	}
	jobs.Register(mux, allow)
	cfg := sched.AsynqConfig()
	cfg.ShutdownTimeout = 10 * time.Second
	srv := asynq.NewServer(redisOpt, cfg)

	web, err := serveMetrics(sched.Config().Worker, reg, redisOpt, log)
	if err != nil {
		fmt.Fprintf(os.Stderr, "worker: metrics server: %v\n", err)
		return 1
	}
	defer web.Shutdown(context.Background())

	go sched.Run(ctx)
	go config.Watch(ctx, *path, file, func(f config.File) {
		if err := sched.Apply(f.Jobs); err != nil {
			log.Error("config change refused; the last good config stays in force", "err", err)
			return
		}
		log.Info("config change in force", "path", *path)
	}, func(err error) {
		log.Error("config change refused; the last good config stays in force", "err", err)
	})

	if err := srv.Start(mux); err != nil {
		fmt.Fprintf(os.Stderr, "worker: %v\n", err)
		return 1
	}
	log.Info("worker running", "queues", cfg.Queues, "concurrency", cfg.Concurrency, "metrics", web.Addr)
	if *demo > 0 {
		go runDemo(ctx, redisOpt, sched.Config(), *demo, os.Stdout, log)
	}
	<-ctx.Done()
	log.Info("stopping: waiting for running tasks")
	srv.Shutdown()
	return 0
}

// serveMetrics serves Prometheus metrics on /metrics and asynqmon's web UI
// on /ui/ (see webUI) at w.MetricsAddr.
func serveMetrics(w jobs.WorkerConfig, reg *prometheus.Registry, redisOpt asynq.RedisConnOpt, log *slog.Logger) (*http.Server, error) {
	ln, err := net.Listen("tcp", w.MetricsAddr)
	if err != nil {
		return nil, err
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	mux.Handle("/ui/", webUI(w.UI, redisOpt))
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) { fmt.Fprintln(w, "ok") })
	srv := &http.Server{Addr: ln.Addr().String(), Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go func() {
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Error("metrics server stopped", "err", err)
		}
	}()
	return srv, nil
}

// logLevel reads SLUICE_LOG_LEVEL (debug, info, warn, error; default info).
func logLevel() slog.Level {
	var level slog.Level
	if err := level.UnmarshalText([]byte(os.Getenv("SLUICE_LOG_LEVEL"))); err != nil {
		return slog.LevelInfo
	}
	return level
}
