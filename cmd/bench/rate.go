package main

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/hibiken/asynq"

	"github.com/sluicehq/sluice/internal/testkit"
	"github.com/sluicehq/sluice/jobs"
)

// rateWorkers is how many worker processes drain the queue.
const rateWorkers = 4

// rateSeconds is how long each rate is held: the tasks are rate × it. The
// issue asks for 10 s within 2%, counted after the first second.
const rateSeconds = 11

// runRate finds the highest rate one queue drains at within 2% on this
// machine: the real worker binary, built for the run, in rateWorkers
// processes, drains http:request tasks (half with MaxRetry 0) through a
// leaky bucket of burst 1 to a local server that notes when each request
// arrives, at rising rates. What bounds it shows in the CPU each part used
// per task.
func runRate(ctx context.Context, b *bench) error {
	dir, binary, err := buildWorker(ctx, b, "rate")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	api := newArrivals()
	defer api.Close()

	fmt.Fprintf(b.out, `
### one queue at high rates

%d worker processes (the real binary, built for the run; concurrency 50 each) drain one queue of http:request tasks, half with MaxRetry 0, loaded before they start, through a leaky bucket of burst 1 at each rate for about %d s (10 s after the first second), to a local server that notes when each request arrives. Achieved: the requests over the time from the first to the last; after the first second: the same from one second after the first request, once the workers have booked the backlog (each task books its turn as soon as a worker takes it, and most go back to Redis to wait for it: the first second spends much of the machine on that). Within 2%%: after the first second, and no second above the rate + 2%%. CPU per task: the workers' (user + system, from their exit), redis-server's (INFO cpu) and the API server's and bench's own (this process), over the run.

| drain | achieved | after the first second | within 2%% | most in any second | worker CPU µs/task | Redis CPU µs/task | API + bench CPU µs/task | CPU used of %d cores |
|--:|--:|--:|:-:|--:|--:|--:|--:|--:|
`, rateWorkers, rateSeconds, runtime.NumCPU())
	best := 0
	for _, rate := range []int{500, 1000, 2000, 3000, 4000} {
		b.progress("rate: %d/s", rate)
		r, err := drainAt(ctx, b, binary, dir, api, rate)
		if err != nil {
			return fmt.Errorf("rate %d/s: %w", rate, err)
		}
		within := r.steady >= 0.98*float64(rate) && r.steady <= 1.02*float64(rate) && float64(r.most) <= 1.02*float64(rate)
		mark := "no"
		if within {
			mark, best = "yes", rate
		}
		n := float64(r.tasks)
		fmt.Fprintf(b.out, "| %s/s | %s/s | %s/s | %s | %s | %.0f | %.0f | %.0f | %.2f |\n", grouped(float64(rate)), grouped(r.achieved), grouped(r.steady), mark, grouped(float64(r.most)),
			r.workerCPU.Seconds()*1e6/n, r.redisCPU.Seconds()*1e6/n, r.selfCPU.Seconds()*1e6/n,
			(r.workerCPU+r.redisCPU+r.selfCPU).Seconds()/r.elapsed.Seconds())
	}
	fmt.Fprintf(b.out, "\nHighest rate held within 2%%: %s/s.\n", grouped(float64(best)))
	return nil
}

// rateRun is what one drainAt saw.
type rateRun struct {
	tasks                        int
	achieved                     float64 // requests per second, first to last
	steady                       float64 // requests per second after the first second
	most                         int     // requests in the busiest second
	elapsed                      time.Duration
	workerCPU, redisCPU, selfCPU time.Duration
}

// drainAt loads rate × rateSeconds tasks, drains them with rateWorkers
// workers at rate, and stops the workers.
func drainAt(ctx context.Context, b *bench, binary, dir string, api *arrivals, rate int) (rateRun, error) {
	queue := fmt.Sprintf("%s-rate-%d", b.runID, rate)
	n := rate * rateSeconds
	config := filepath.Join(dir, fmt.Sprintf("rate-%d.yaml", rate))
	yaml := fmt.Sprintf("redis: {addr: %q}\nworker: {concurrency: 50}\nqueues:\n  %s: {drain: {algorithm: leaky_bucket, limit: %d, period: 1s, burst: 1}}\nhttp: {allow: [%q]}\n",
		b.addr, queue, rate, api.Listener.Addr().String())
	if err := os.WriteFile(config, []byte(yaml), 0o644); err != nil {
		return rateRun{}, err
	}
	inspector := asynq.NewInspector(asynq.RedisClientOpt{Addr: b.addr})
	defer inspector.Close()
	defer inspector.DeleteQueue(queue, true)
	prefix := fmt.Sprintf("/rate-%d/", rate)
	if err := loadRequests(asynq.RedisClientOpt{Addr: b.addr}, queue, api.URL+prefix, n); err != nil {
		return rateRun{}, err
	}

	redisBefore, err := redisCPU(ctx, b)
	if err != nil {
		return rateRun{}, err
	}
	selfBefore := selfCPU()
	var workers []*exec.Cmd
	stop := func() {
		for _, w := range workers {
			w.Process.Signal(syscall.SIGTERM)
		}
		for _, w := range workers {
			w.Wait()
		}
	}
	for range rateWorkers {
		w := exec.CommandContext(ctx, binary, "--config", config)
		w.Env = append(os.Environ(), "SLUICE_WORKER_METRICS_ADDR="+freeLoopback())
		if err := w.Start(); err != nil {
			stop()
			return rateRun{}, err
		}
		workers = append(workers, w)
	}
	deadline := time.Now().Add(time.Duration(3*rateSeconds+30) * time.Second)
	for api.count(prefix) < n {
		if time.Now().After(deadline) {
			stop()
			return rateRun{}, fmt.Errorf("only %d of %d requests after %v", api.count(prefix), n, time.Duration(3*rateSeconds+30)*time.Second)
		}
		time.Sleep(20 * time.Millisecond)
	}
	stop()
	r := rateRun{tasks: n, selfCPU: selfCPU() - selfBefore}
	for _, w := range workers {
		r.workerCPU += w.ProcessState.UserTime() + w.ProcessState.SystemTime()
	}
	redisAfter, err := redisCPU(ctx, b)
	if err != nil {
		return rateRun{}, err
	}
	r.redisCPU = redisAfter - redisBefore
	times := api.times(prefix)
	r.elapsed = times[len(times)-1].Sub(times[0])
	r.achieved = float64(len(times)-1) / r.elapsed.Seconds()
	r.steady = steadyRate(times)
	for first, last := 0, 0; last < len(times); last++ {
		for times[last].Sub(times[first]) >= time.Second {
			first++
		}
		r.most = max(r.most, last-first+1)
	}
	return r, nil
}

// steadyRate is the requests per second from one second after the first
// to the last: the workers have booked the backlog by then.
func steadyRate(times []time.Time) float64 {
	from := times[0].Add(time.Second)
	i, _ := slices.BinarySearchFunc(times, from, time.Time.Compare)
	if len(times)-i < 2 {
		return 0
	}
	return float64(len(times)-i-1) / times[len(times)-1].Sub(times[i]).Seconds()
}

// loadRequests enqueues n http:request tasks to url<i> into queue from 8
// clients at once, every other one with MaxRetry 0.
func loadRequests(opt asynq.RedisClientOpt, queue, url string, n int) error {
	client := asynq.NewClient(opt)
	defer client.Close()
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for w := range 8 {
		wg.Go(func() {
			for i := w; i < n; i += 8 {
				task, err := jobs.NewHTTPRequestTask(jobs.HTTPRequestPayload{URL: url + strconv.Itoa(i)})
				if err == nil {
					opts := []asynq.Option{asynq.Queue(queue)}
					if i%2 == 0 {
						opts = append(opts, asynq.MaxRetry(0))
					}
					_, err = client.Enqueue(task, opts...)
				}
				if err != nil {
					errs <- err
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	return <-errs
}

// arrivals is a local API server that notes when each request arrives, by
// path.
type arrivals struct {
	*httptest.Server
	mu  sync.Mutex
	log map[string][]time.Time // by the path's first segment
}

func newArrivals() *arrivals {
	a := &arrivals{log: map[string][]time.Time{}}
	a.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		now := time.Now()
		prefix := r.URL.Path[:strings.IndexByte(r.URL.Path[1:], '/')+2]
		a.mu.Lock()
		a.log[prefix] = append(a.log[prefix], now)
		a.mu.Unlock()
	}))
	return a
}

func (a *arrivals) count(prefix string) int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return len(a.log[prefix])
}

func (a *arrivals) times(prefix string) []time.Time {
	a.mu.Lock()
	defer a.mu.Unlock()
	return slices.SortedFunc(slices.Values(a.log[prefix]), time.Time.Compare)
}

// redisCPU is the CPU time redis-server has used (INFO cpu).
func redisCPU(ctx context.Context, b *bench) (time.Duration, error) {
	info, err := b.rdb.Info(ctx, "cpu").Result()
	if err != nil {
		return 0, fmt.Errorf("INFO cpu: %w", err)
	}
	var total float64
	for _, field := range []string{"used_cpu_sys", "used_cpu_user"} {
		v, err := strconv.ParseFloat(infoField(info, field), 64)
		if err != nil {
			return 0, fmt.Errorf("INFO cpu: %s: %w", field, err)
		}
		total += v
	}
	return time.Duration(total * float64(time.Second)), nil
}

// selfCPU is the CPU time this process has used.
func selfCPU() time.Duration {
	var ru syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// freeLoopback is a loopback address with a port nothing listens on now,
// kept from the tests' servers until the bench exits
// (testkit.ReservePort); with none free, any port (127.0.0.1:0).
func freeLoopback() string {
	port, _, err := testkit.ReservePort()
	if err != nil {
		return "127.0.0.1:0"
	}
	return net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
}

// buildWorker builds cmd/worker into a new temporary directory named for
// section, and returns the directory (the caller removes it) and the
// binary's path.
func buildWorker(ctx context.Context, b *bench, section string) (dir, binary string, err error) {
	dir, err = os.MkdirTemp("", "sluice-bench-"+section+"-")
	if err != nil {
		return "", "", err
	}
	b.progress("building cmd/worker into %s", dir)
	binary = filepath.Join(dir, "worker")
	if out, err := exec.CommandContext(ctx, "go", "build", "-o", binary, "github.com/sluicehq/sluice/cmd/worker").CombinedOutput(); err != nil {
		os.RemoveAll(dir)
		return "", "", fmt.Errorf("go build cmd/worker: %w\n%s", err, out)
	}
	return dir, binary, nil
}
