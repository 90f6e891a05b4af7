// Worker processes: started from the binaries TestMain built, on a config
// file, stopped with the test; their logs and metrics read back.

package test

import (
	"bufio"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/sluicehq/sluice/internal/testkit"
)

// worker is one running worker process.
type worker struct {
	cmd     *exec.Cmd
	metrics string        // host:port of its metrics server
	log     string        // path of its log file
	exited  chan struct{} // closed once the process has exited
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
	w := &worker{metrics: testkit.FreeAddr(t), log: filepath.Join(t.TempDir(), "worker.log")}
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
	w.exited = exited
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

// stop stops the worker with SIGTERM, as an operator would, and waits for
// it to exit.
func (w *worker) stop(t *testing.T) {
	t.Helper()
	w.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-w.exited:
	case <-time.After(15 * time.Second):
		t.Fatalf("worker %s did not stop within 15 s of SIGTERM", w.metrics)
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
