package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"os"
	"time"

	"github.com/hibiken/asynq"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/spf13/cobra"

	"github.com/sluicehq/sluice/internal/config"
	"github.com/sluicehq/sluice/throttle"
	"github.com/sluicehq/sluice/throttle/httplimit"
)

// maxBody bounds a request body: a task is a type, a payload and options.
const maxBody = 1 << 20

func newServeCommand(a *app) *cobra.Command {
	var listen string
	cmd := &cobra.Command{
		Use:   "serve [--listen HOST:PORT]",
		Short: "Serve the HTTP intake: POST /v1/tasks, rate-limited per client, per IP and overall",
		Long: `Serve an HTTP intake for tasks until SIGINT or SIGTERM.

  POST /v1/tasks  {"type": "...", "payload": {...}, "queue": "...", "options": {...}}
                  202 {"id": ..., "queue": ...}; 400 bad input; 409 task id taken;
                  429 over a limit or banned (Retry-After); 503 Redis failed
  GET  /healthz   200 ok
  GET  /metrics   Prometheus

The body is what one line of --file holds. The limits of gateway.limits in
the config are checked together, all or nothing, before a task is read into
Redis; a client that keeps being refused is banned (gateway.ban).`,
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
	limits, err := gatewayLimits(f.Gateway)
	if err != nil {
		return badInput(err)
	}
	log := slog.New(slog.NewTextHandler(cmd.ErrOrStderr(), nil))
	rdb := f.Redis.Client()
	defer rdb.Close()
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	limiter, err := httplimit.New(rdb, limits, httplimit.WithRegisterer(reg), httplimit.WithLogger(log),
		httplimit.WithKeyFunc(func(r *http.Request) string { return taskTypeOf(r.Context()) }))
	if err != nil {
		return badInput(err)
	}
	client := asynq.NewClient(f.Redis.AsynqOpt())
	defer client.Close()
	intake := &intake{client: client, accepted: prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "sluice_intake_requests_total",
		Help: "Task requests the intake answered, by status code.",
	}, []string{"code"})}
	reg.MustRegister(intake.accepted)

	mux := http.NewServeMux()
	mux.Handle("POST /v1/tasks", readTask(limiter.Middleware(intake)))
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) { fmt.Fprintln(w, "ok") })
	mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))

	ln, err := net.Listen("tcp", listen)
	if err != nil {
		return fmt.Errorf("serve: %w", err)
	}
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second, ReadTimeout: 30 * time.Second}
	ctx := cmd.Context()
	go func() {
		<-ctx.Done()
		shutdown, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		defer cancel()
		srv.Shutdown(shutdown)
	}()
	log.Info("intake serving", "addr", ln.Addr().String(), "limits", len(limits.Limits))
	fmt.Fprintf(cmd.OutOrStdout(), "serving on http://%s\n", ln.Addr())
	if err := srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

// gatewayLimits turns the config's gateway section into httplimit's.
func gatewayLimits(g config.Gateway) (httplimit.Config, error) {
	c := httplimit.Config{Ban: httplimit.Ban{After: g.Ban.After, Within: g.Ban.Within, For: g.Ban.For, Max: g.Ban.Max}}
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

// readTask reads and checks the body before the limits see the request.
func readTask(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxBody))
		var res readResult
		switch {
		case err != nil:
			res.err = fmt.Errorf("reading the body: %w (at most %d bytes)", err, maxBody)
		default:
			res.task, res.err = decodeLine(body, lineDefaults{queue: "default"}, time.Now())
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
	accepted *prometheus.CounterVec
}

func (in *intake) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	res, _ := r.Context().Value(taskKey{}).(readResult)
	if res.err != nil {
		in.answer(w, http.StatusBadRequest, map[string]string{"error": res.err.Error()})
		return
	}
	t := res.task
	info, err := in.client.EnqueueContext(r.Context(), t.task, t.opts...)
	switch {
	case errors.Is(err, asynq.ErrTaskIDConflict):
		in.answer(w, http.StatusConflict, map[string]string{"error": "task id " + t.taskID + " is taken in queue " + t.queue, "id": t.taskID, "queue": t.queue})
	case errors.Is(err, asynq.ErrDuplicateTask):
		in.answer(w, http.StatusConflict, map[string]string{"error": "a task with the same type and payload is unique in queue " + t.queue + " for now", "queue": t.queue})
	case err != nil:
		w.Header().Set("Retry-After", "1")
		in.answer(w, http.StatusServiceUnavailable, map[string]string{"error": "could not enqueue: Redis failed; try again"})
		fmt.Fprintln(os.Stderr, "serve: enqueue:", err)
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
