package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"time"

	"github.com/hibiken/asynq"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/spf13/cobra"
	"golang.org/x/net/netutil"

	"github.com/sluicehq/sluice/config"
	"github.com/sluicehq/sluice/intake"
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
	if err := intake.Closed(f.Gateway); err != nil {
		return badInput(fmt.Errorf("serve: %w", err))
	}
	log := slog.New(slog.NewTextHandler(cmd.ErrOrStderr(), nil))
	rdb := f.Redis.Client()
	defer rdb.Close()
	if err := checkLogin(cmd.Context(), f.Redis, rdb); err != nil {
		return err
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	client := asynq.NewClient(f.Redis.AsynqOpt())
	defer client.Close()
	in, err := intake.New(f, rdb, client, intake.WithRegisterer(reg), intake.WithLogger(log))
	if err != nil {
		return badInput(err)
	}
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
		Handler:           in,
		ReadHeaderTimeout: 5 * time.Second,
		ReadTimeout:       intake.BodyTimeout + 5*time.Second, // the body's own deadline is set once the checks pass
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
		if closed := in.Reload(f); closed != nil {
			log.Error("config change in force: the intake has no clients configured and refuses every request (503)", "clients", 0, "err", closed)
			return
		}
		log.Info("config change in force: gateway.clients, gateway.types and the queues", "clients", len(f.Gateway.Clients))
	}, func(err error) {
		log.Error("config change refused; the last good clients stay in force", "err", err)
	})
	log.Info("intake serving", "addr", ln.Addr().String(), "metrics", metricsLn.Addr().String(),
		"limits", len(f.Gateway.Limits), "clients", len(f.Gateway.Clients), "max_connections", f.Gateway.MaxConnections)
	fmt.Fprintf(cmd.OutOrStdout(), "serving on http://%s\n", ln.Addr())
	if err := srv.Serve(netutil.LimitListener(ln, f.Gateway.MaxConnections)); !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}
