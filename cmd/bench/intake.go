package main

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
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
)

// intakeClients is how many clients post to the intake at once.
const intakeClients = 50

// runIntake measures `enqueue serve` (the real binary, built for the run)
// with three token-bucket limits (global, client, ip) far above the load
// against the same intake with no limits: what the limits' check costs a
// request. Every request enqueues a task, so both pay for Redis twice or
// once per request; the queue is emptied between rounds.
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
	for name, gateway := range map[string]string{withLimits: limits, noLimits: ""} {
		addr, stop, err := startIntake(ctx, binary, filepath.Join(dir, strings.ReplaceAll(name, " ", "-")+".yaml"), b, queue, gateway)
		if err != nil {
			return err
		}
		defer stop()
		servers[name] = addr
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
	rates, err := inRounds(ctx, b, []measurement{{withLimits, measure(servers[withLimits])}, {noLimits, measure(servers[noLimits])}})
	if err != nil {
		return err
	}
	fmt.Fprintf(b.out, `
### enqueue serve: what the limits cost

%d clients post `+"`{\"type\": \"demo:noop\"}`"+` to one `+"`enqueue serve`"+` (built for the run; keep-alive connections) for %v: one intake with three token-bucket limits (global, client, ip) far above the load, one with none. Each accepted request enqueues a task on the same redis-server; the limits are checked with one `+"`throttle.Book`"+`, one script run for all three (a single server). Median of %d rounds, rows interleaved.

| intake | requests/s | ratio to no limits |
|---|--:|--:|
| %s | %s | %.2f |
| %s | %s | 1.00 |

`, intakeClients, b.duration, b.rounds,
		withLimits, grouped(rates[withLimits]), rates[withLimits]/rates[noLimits],
		noLimits, grouped(rates[noLimits]))
	return nil
}

// startIntake writes a config at path and starts `enqueue serve` on it; it
// returns the address it serves and how to stop it.
func startIntake(ctx context.Context, binary, path string, b *bench, queue, limits string) (string, func(), error) {
	listen, err := freeAddr()
	if err != nil {
		return "", nil, err
	}
	metrics, err := freeAddr()
	if err != nil {
		return "", nil, err
	}
	config := fmt.Sprintf("redis: {addr: %q}\nqueues:\n  %s: {}\ngateway:\n  listen: %s\n  metrics_addr: %s\n  max_connections: %d\n%s",
		b.addr, queue, listen, metrics, 4*intakeClients, limits)
	if err := os.WriteFile(path, []byte(config), 0o644); err != nil {
		return "", nil, err
	}
	cmd := exec.CommandContext(ctx, binary, "--config", path, "serve")
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return "", nil, err
	}
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		return "", nil, err
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
			return "", nil, fmt.Errorf("enqueue serve did not start: %s", stderr.String())
		}
	case <-time.After(20 * time.Second):
		stop()
		return "", nil, fmt.Errorf("enqueue serve did not start within 20s: %s", stderr.String())
	}
	return listen, stop, nil
}

func freeAddr() (string, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer ln.Close()
	return ln.Addr().String(), nil
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
