package main

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hibiken/asynq"
	"golang.org/x/net/netutil"

	"github.com/sluicehq/sluice/config"
	"github.com/sluicehq/sluice/intake"
)

// intakeClients is how many clients post to the intake at once.
const intakeClients = 50

// runIntake measures `enqueue serve` (the real binary, built for the run)
// with three token-bucket limits (global, client, ip) far above the load
// against the same intake with no limits: what the limits' check costs a
// request; and the same two intakes served in this process by package
// intake, on the same configs, against the binary. Every request enqueues
// a task, so both pay for Redis twice or once per request; the queue is
// emptied between rounds.
func runIntake(ctx context.Context, b *bench) error {
	dir, err := os.MkdirTemp("", "sluice-bench-intake-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	b.progress("building cmd/enqueue into %s", dir)
	binary := filepath.Join(dir, "enqueue")
	build := exec.CommandContext(ctx, "go", "build", "-o", binary, "github.com/sluicehq/sluice/cmd/enqueue")
	if out, err := build.CombinedOutput(); err != nil {
		return fmt.Errorf("go build cmd/enqueue: %w\n%s", err, out)
	}
	queue := b.runID + "-intake"
	const limits = `  limits:
    - {name: overall, key: global, algorithm: token_bucket, limit: 10000000, period: 1s}
    - {name: per-client, key: client, algorithm: token_bucket, limit: 10000000, period: 1s}
    - {name: per-ip, key: ip, algorithm: token_bucket, limit: 10000000, period: 1s}
`
	const (
		withLimits = "three limits (global, client, ip)"
		noLimits   = "no limits"
	)
	servers := map[string]string{}
	inProcess := map[string]string{}
	for name, gateway := range map[string]string{withLimits: limits, noLimits: ""} {
		path := filepath.Join(dir, strings.ReplaceAll(name, " ", "-")+".yaml")
		listen, err := writeIntakeConfig(path, b, queue, gateway)
		if err != nil {
			return err
		}
		stop, err := startIntake(ctx, binary, path)
		if err != nil {
			return err
		}
		defer stop()
		servers[name] = listen
		addr, stopServing, err := serveIntake(path)
		if err != nil {
			return err
		}
		defer stopServing()
		inProcess[name] = addr
	}
	inspector := asynq.NewInspector(asynq.RedisClientOpt{Addr: b.addr})
	defer inspector.Close()
	defer inspector.DeleteQueue(queue, true)
	body := []byte(fmt.Sprintf(`{"type": "demo:noop", "queue": %q}`, queue))
	measure := func(addr string) func(context.Context) (float64, error) {
		return func(ctx context.Context) (float64, error) {
			defer inspector.DeleteQueue(queue, true)
			return postLoad(ctx, "http://"+addr+"/v1/tasks", body, b.duration)
		}
	}
	const inProcessSuffix = ", in process"
	rates, err := inRounds(ctx, b, []measurement{
		{withLimits, measure(servers[withLimits])}, {noLimits, measure(servers[noLimits])},
		{withLimits + inProcessSuffix, measure(inProcess[withLimits])}, {noLimits + inProcessSuffix, measure(inProcess[noLimits])},
	})
	if err != nil {
		return err
	}
	row := func(name string) string {
		rate, own := rates[name], rates[strings.TrimSuffix(name, inProcessSuffix)]
		return fmt.Sprintf("| %s | %s | %.2f | %.2f |", name, grouped(rate), rate/rates[strings.Replace(name, withLimits, noLimits, 1)], rate/own)
	}
	fmt.Fprintf(b.out, `
### enqueue serve: what the limits cost

%d clients post `+"`{\"type\": \"demo:noop\"}`"+` to one `+"`enqueue serve`"+` (built for the run; keep-alive connections) for %v: one intake with three token-bucket limits (global, client, ip) far above the load, one with none. Each accepted request enqueues a task on the same redis-server; the limits are checked with one `+"`throttle.Book`"+`, one script run for all three (a single server). The rows "in process" serve the same configs from this process through package intake (`+"`intake.New`"+` behind an http.Server set up as the command's), so the clients and the intake share one process. Median of %d rounds, rows interleaved.

| intake | requests/s | ratio to no limits | ratio to the binary |
|---|--:|--:|--:|
%s
%s
%s
%s

`, intakeClients, b.duration, b.rounds, row(withLimits), row(noLimits), row(withLimits+inProcessSuffix), row(noLimits+inProcessSuffix))
	return nil
}

// writeIntakeConfig writes at path the config of an intake with limits
// (gateway.limits, indented) that enqueues to queue, and returns the
// address it names for the intake to listen on.
func writeIntakeConfig(path string, b *bench, queue, limits string) (string, error) {
	listen, metrics := freeLoopback(), freeLoopback()
	config := fmt.Sprintf("redis: {addr: %q}\nqueues:\n  %s: {}\ngateway:\n  listen: %s\n  metrics_addr: %s\n  max_connections: %d\n%s",
		b.addr, queue, listen, metrics, 4*intakeClients, limits)
	return listen, os.WriteFile(path, []byte(config), 0o644)
}

// startIntake starts `enqueue serve` on the config at path and waits until
// it serves; it returns how to stop it.
func startIntake(ctx context.Context, binary, path string) (func(), error) {
	cmd := exec.CommandContext(ctx, binary, "--config", path, "serve")
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	stop := func() {
		cmd.Process.Signal(os.Interrupt)
		cmd.Wait()
	}
	// It says "serving on http://ADDR" once it listens.
	ready := make(chan bool, 1)
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			if strings.HasPrefix(sc.Text(), "serving on ") {
				ready <- true
				io.Copy(io.Discard, stdout)
				return
			}
		}
		ready <- false
	}()
	select {
	case ok := <-ready:
		if !ok {
			stop()
			return nil, fmt.Errorf("enqueue serve did not start: %s", stderr.String())
		}
	case <-time.After(20 * time.Second):
		stop()
		return nil, fmt.Errorf("enqueue serve did not start within 20s: %s", stderr.String())
	}
	return stop, nil
}

// serveIntake serves the intake of the config at path from this process,
// as `enqueue serve` does (an http.Server with the same timeouts and
// connection cap), on a port of its own; it returns the address and how
// to stop it.
func serveIntake(path string) (string, func(), error) {
	f, err := config.Load(path)
	if err != nil {
		return "", nil, err
	}
	rdb := f.Redis.Client()
	client := asynq.NewClient(f.Redis.AsynqOpt())
	in, err := intake.New(f, rdb, client, intake.WithLogger(slog.New(slog.DiscardHandler)))
	if err != nil {
		client.Close()
		rdb.Close()
		return "", nil, err
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		client.Close()
		rdb.Close()
		return "", nil, err
	}
	srv := &http.Server{
		Handler:           in,
		ReadHeaderTimeout: 5 * time.Second,
		ReadTimeout:       intake.BodyTimeout + 5*time.Second,
		WriteTimeout:      15 * time.Second,
		IdleTimeout:       60 * time.Second,
		MaxHeaderBytes:    32 << 10,
	}
	go srv.Serve(netutil.LimitListener(ln, f.Gateway.MaxConnections))
	return ln.Addr().String(), func() {
		srv.Close()
		client.Close()
		rdb.Close()
	}, nil
}

// postLoad has intakeClients clients post body to url for d and returns
// the accepted requests per second; any other answer fails the round.
func postLoad(ctx context.Context, url string, body []byte, d time.Duration) (float64, error) {
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: intakeClients}}
	defer client.CloseIdleConnections()
	ctx, cancel := context.WithTimeout(ctx, d)
	defer cancel()
	var accepted atomic.Int64
	var failure atomic.Value
	var wg sync.WaitGroup
	start := time.Now()
	for range intakeClients {
		wg.Go(func() {
			for ctx.Err() == nil {
				req, _ := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(body))
				resp, err := client.Do(req)
				if err != nil {
					if ctx.Err() == nil {
						failure.Store(err)
					}
					return
				}
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				if resp.StatusCode != http.StatusAccepted {
					failure.Store(fmt.Errorf("POST %s: %s", url, resp.Status))
					return
				}
				accepted.Add(1)
			}
		})
	}
	wg.Wait()
	if err, ok := failure.Load().(error); ok {
		return 0, err
	}
	return float64(accepted.Load()) / time.Since(start).Seconds(), nil
}
