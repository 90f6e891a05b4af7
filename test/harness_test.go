// Package test holds sluice's end-to-end tests: real worker processes, built
// from cmd/worker, examples/worker, test/panicworker and test/customerworker, against the real redis-server that `make test` starts,
// with a local HTTP server standing in for a third-party API.
package test

import (
	"bufio"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/sluicehq/sluice/internal/redistest"
	"github.com/sluicehq/sluice/internal/testkit"
	"github.com/sluicehq/sluice/jobs"
)

// bin holds the binaries TestMain builds.
var bin string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "sluice-e2e-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	bin = dir
	// -buildvcs=auto: --version shows the revision where git can tell it,
	// whatever GOFLAGS says.
	for out, pkgs := range map[string][]string{dir + "/": {"../cmd/..."}, dir + "/examples/": {"../examples/..."}, dir + "/test/": {"./panicworker", "./customerworker"}} {
		build := exec.Command("go", append([]string{"build", "-buildvcs=auto", "-o", out}, pkgs...)...)
		build.Stdout, build.Stderr = os.Stdout, os.Stderr
		if err := build.Run(); err != nil {
			fmt.Fprintf(os.Stderr, "building %s: %v\n", pkgs, err)
			os.Exit(1)
		}
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// worker is one running worker process.
type worker struct {
	cmd     *exec.Cmd
	metrics string // host:port of its metrics server
	log     string // path of its log file
}

// writeConfig writes a config file for the test and returns its path.
func writeConfig(t *testing.T, yaml string) string {
	t.Helper()
	return writeFile(t, "config.yaml", yaml)
}

// writeFile writes content to a file called name in a new directory and
// returns its path.
func writeFile(t *testing.T, name, content string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

func freeAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

// startWorker starts a worker on the config file and waits until its
// metrics server answers. It is stopped (SIGTERM) when the test ends.
func startWorker(t *testing.T, config string, env ...string) *worker {
	t.Helper()
	return startWorkerBinary(t, "worker", []string{"--config", config}, env...)
}

// startWorkerBinary starts a worker built from the package of binary, a path
// in bin ("worker", "examples/worker", "test/panicworker", "test/customerworker"), with args, as startWorker does.
func startWorkerBinary(t *testing.T, binary string, args []string, env ...string) *worker {
	t.Helper()
	w := &worker{metrics: freeAddr(t), log: filepath.Join(t.TempDir(), "worker.log")}
	logFile, err := os.Create(w.log)
	if err != nil {
		t.Fatal(err)
	}
	w.cmd = exec.Command(filepath.Join(bin, binary), args...)
	w.cmd.Env = append(os.Environ(), append([]string{"SLUICE_WORKER_METRICS_ADDR=" + w.metrics}, env...)...)
	w.cmd.Stdout, w.cmd.Stderr = logFile, logFile
	if err := w.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan struct{})
	go func() {
		w.cmd.Wait()
		logFile.Close()
		close(exited)
	}()
	// Every worker is stopped with SIGTERM and must stop gracefully: exit
	// code 0 within its 10 s shutdown timeout (a worker the test killed
	// with -9 excepted).
	t.Cleanup(func() {
		w.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-exited:
			st := w.cmd.ProcessState
			ws, _ := st.Sys().(syscall.WaitStatus)
			if !st.Success() && !(ws.Signaled() && ws.Signal() == syscall.SIGKILL) {
				t.Errorf("worker %s stopped by SIGTERM: %v, want exit code 0", w.metrics, st)
			}
		case <-time.After(15 * time.Second):
			t.Errorf("worker %s did not stop within 15 s of SIGTERM", w.metrics)
			w.cmd.Process.Kill()
			<-exited
		}
		if t.Failed() {
			b, _ := os.ReadFile(w.log)
			t.Logf("worker %s log:\n%s", w.metrics, tail(string(b), 40))
		}
	})
	deadline := time.Now().Add(20 * time.Second)
	for {
		resp, err := http.Get("http://" + w.metrics + "/healthz")
		if err == nil {
			resp.Body.Close()
			return w
		}
		select {
		case <-exited:
			b, _ := os.ReadFile(w.log)
			t.Fatalf("worker exited at start: %s", b)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("worker did not come up: %v", err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func tail(s string, lines int) string {
	all := strings.Split(strings.TrimRight(s, "\n"), "\n")
	return strings.Join(all[max(0, len(all)-lines):], "\n")
}

// counter sums the samples of a counter in a worker's metrics whose labels
// contain every one of match (e.g. `gate="drain:q"`).
func (w *worker) counter(t *testing.T, name string, match ...string) float64 {
	t.Helper()
	resp, err := http.Get("http://" + w.metrics + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	sum := 0.0
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, name+"{") && !strings.HasPrefix(line, name+" ") {
			continue
		}
		ok := true
		for _, m := range match {
			ok = ok && strings.Contains(line, m)
		}
		if !ok {
			continue
		}
		v, err := strconv.ParseFloat(line[strings.LastIndexByte(line, ' ')+1:], 64)
		if err == nil {
			sum += v
		}
	}
	return sum
}

// upstream is a local HTTP server standing in for a third-party API: it
// notes the time of every request, and answers with what respond says.
type upstream struct {
	*httptest.Server
	testkit.Timeline // arrivals by path
	mu               sync.Mutex
	respond          func(n int) (status int, retryAfter string)
	// respondTo, if set, answers instead of respond, by the request's path;
	// it is called under mu, one request at a time.
	respondTo func(path string) (status int, retryAfter string)
	n         int
}

// allowYAML is the http section of a config that lets http:request call u.
func (u *upstream) allowYAML() string {
	return fmt.Sprintf("http: {allow: ['%s']}\n", u.Listener.Addr())
}

// Under returns the arrival times of the requests whose path is under
// /prefix/, sorted.
func (u *upstream) Under(prefix string) []time.Time {
	return u.Matching(func(path string) bool { return strings.HasPrefix(path, "/"+prefix+"/") })
}

func newUpstream(t *testing.T) *upstream {
	u := &upstream{}
	u.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		u.Note(r.URL.Path)
		u.mu.Lock()
		u.n++
		n, respond := u.n, u.respond
		if u.respondTo != nil {
			status, retryAfter := u.respondTo(r.URL.Path)
			respond = func(int) (int, string) { return status, retryAfter }
		}
		u.mu.Unlock()
		if respond != nil {
			if status, retryAfter := respond(n); status != http.StatusOK {
				if retryAfter != "" {
					w.Header().Set("Retry-After", retryAfter)
				}
				w.WriteHeader(status)
				return
			}
		}
		w.WriteHeader(http.StatusOK)
	}))
	t.Cleanup(u.Close)
	return u
}

// enqueueRequests enqueues n http:request tasks into queue with a plain
// asynq.Client, each calling u at its own path; every other one has
// MaxRetry 0, which the asynq wiki's throttling pattern would archive.
func enqueueRequests(t *testing.T, u *upstream, queue, prefix string, n int) {
	t.Helper()
	enqueueRequestsOn(t, asynq.RedisClientOpt{Addr: redistest.Addr(t)}, u, queue, prefix, n)
}

// enqueueRequestsOn is enqueueRequests on the Redis of opt.
func enqueueRequestsOn(t *testing.T, opt asynq.RedisConnOpt, u *upstream, queue, prefix string, n int) {
	t.Helper()
	client := asynq.NewClient(opt)
	defer client.Close()
	enqueueWithHeaders(t, client, u.URL, queue, prefix, n, nil)
}

// enqueueWithHeaders puts n http:request tasks into queue, each calling
// base at its own path under prefix with the headers, every other one with
// MaxRetry 0.
func enqueueWithHeaders(t *testing.T, client *asynq.Client, base, queue, prefix string, n int, headers map[string]string) {
	t.Helper()
	for i := 0; i < n; i++ {
		task, err := jobs.NewHTTPRequestTask(jobs.HTTPRequestPayload{URL: fmt.Sprintf("%s/%s/%d", base, prefix, i), Headers: headers})
		if err != nil {
			t.Fatal(err)
		}
		opts := []asynq.Option{asynq.Queue(queue)}
		if i%2 == 0 {
			opts = append(opts, asynq.MaxRetry(0))
		}
		if _, err := client.Enqueue(task, opts...); err != nil {
			t.Fatal(err)
		}
	}
}

func redisAddr(t *testing.T) string { return redistest.Addr(t) }
