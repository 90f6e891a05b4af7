package test

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/sluicehq/sluice/internal/redistest"
)

// TestEnqueueBadInput: every kind of bad input exits 2 with a message that
// names the problem, and writes nothing.
func TestEnqueueBadInput(t *testing.T) {
	t.Parallel()
	addr := redistest.Addr(t)
	sleepLine := func(int) string { return `{"type": "demo:sleep", "payload": {"ms": 1}}` }
	cases := []struct {
		desc string
		args []string
		file string // --file's content, if any
		want []string
	}{
		{desc: "invalid JSON", args: []string{"demo:sleep", `{"ms": 5,}`},
			want: []string{"invalid JSON at byte 10", "demo:sleep"}},
		{desc: "payload not matching its type", args: []string{"demo:sleep", `{"ms": "fast"}`},
			want: []string{`field "ms"`, "want an integer"}},
		{desc: "payload with an unknown field", args: []string{"http:request", `{"uri": "http://127.0.0.1/"}`},
			want: []string{`unknown field "uri"`}},
		{desc: "unknown type", args: []string{"demo:nope", `{}`},
			want: []string{`unknown task type "demo:nope"`, "demo:noop, demo:sleep, http:request"}},
		{desc: "process-in with process-at", args: []string{"demo:noop", "--process-in", "1m", "--process-at", "2030-01-02T15:04:05Z"},
			want: []string{"--process-in", "--process-at"}},
		{desc: "task-id with count", args: []string{"demo:noop", "--task-id", "a", "--count", "2"},
			want: []string{"--task-id", "--count 2"}},
		{desc: "count below 1", args: []string{"demo:noop", "--count", "0"},
			want: []string{"--count must be >= 1, got 0"}},
		{desc: "negative duration", args: []string{"demo:noop", "--process-in", "-5s"},
			want: []string{"--process-in: must not be negative"}},
		{desc: "negative max-retry", args: []string{"demo:noop", "--max-retry", "-1"},
			want: []string{"--max-retry: must be >= 0"}},
		{desc: "queue with a brace", args: []string{"demo:noop", "--queue", "Emails{1}"},
			want: []string{"--queue", `"Emails{1}": queue names are letters, digits`, "'{' is not allowed"}},
		{desc: "unknown queue option in a line", file: `{"type": "demo:noop", "options": {"retries": 3}}`,
			want: []string{`line 1: options: unknown option "retries"`, "max_retry"}},
		{desc: "task id twice in a queue", file: `{"type": "demo:noop", "options": {"task_id": "a"}}` + "\n" + `{"type": "demo:noop", "options": {"task_id": "b"}}` + "\n" +
			`{"type": "demo:noop", "options": {"task_id": "a"}}` + "\n" + `{"type": "demo:noop", "options": {"task_id": 3}}` + "\n",
			want: []string{"has 2 bad lines;", `line 3: task_id "a" is also on line 1 in queue`, "line 4: options.task_id: want a string"}},
		{desc: "task id too long", args: []string{"demo:noop", "--task-id", strings.Repeat("x", 1025)},
			want: []string{"--task-id: is 1025 bytes long; task ids are at most 1024 bytes"}},
		{desc: "task id too long in a line", file: `{"type": "demo:noop", "options": {"task_id": "short"}}` + "\n" +
			`{"type": "demo:noop", "options": {"task_id": "` + strings.Repeat("x", 1025) + `"}}` + "\n",
			want: []string{"has 1 bad line;", "line 2: options.task_id: is 1025 bytes long; task ids are at most 1024 bytes"}},
		{desc: "JSON syntax error in a line", file: "\n" + `{"type": "demo:noop", "payload": {}` + "\n",
			want: []string{"line 2: invalid JSON at byte 35"}},
	}
	for _, c := range cases {
		t.Run(c.desc, func(t *testing.T) {
			queue := redistest.Queue(t, "bad")
			args := append([]string{"--config", enqueueConfig(t, queue)}, c.args...)
			if !slices.Contains(c.args, "--queue") {
				args = append(args, "--queue", queue)
			}
			if c.file != "" {
				path := filepath.Join(t.TempDir(), "tasks.jsonl")
				if err := os.WriteFile(path, []byte(c.file), 0o644); err != nil {
					t.Fatal(err)
				}
				args = append(args, "--file", path)
			}
			r := runEnqueue(t, addr, nil, args...)
			if r.code != 2 {
				t.Errorf("exit code %d, want 2\n%v", r.code, r)
			}
			for _, w := range c.want {
				if !strings.Contains(r.stderr, w) {
					t.Errorf("stderr does not say %q:\n%s", w, r.stderr)
				}
			}
			if r.stdout != "" {
				t.Errorf("stdout %q, want nothing", r.stdout)
			}
			if n := queueSize(t, addr, queue); n != 0 {
				t.Errorf("%d tasks in the queue, want 0", n)
			}
		})
	}

	t.Run("bad line 500 of 1000", func(t *testing.T) {
		queue := redistest.Queue(t, "bad")
		path := writeLines(t, 1000, func(i int) string {
			if i == 500 {
				return `{"type": "demo:sleep", "payload": {"ms": "x"}}`
			}
			return sleepLine(i)
		})
		r := runEnqueue(t, addr, nil, "--config", enqueueConfig(t, queue), "--queue", queue, "--file", path)
		if r.code != 2 || !strings.Contains(r.stderr, "line 500: ") || !strings.Contains(r.stderr, "has 1 bad line;") {
			t.Errorf("want exit 2 and a message naming line 500\n%v", r)
		}
		if strings.Contains(r.stderr, "line 499") || strings.Contains(r.stderr, "line 501") {
			t.Errorf("good lines reported as bad:\n%s", r.stderr)
		}
		if n := queueSize(t, addr, queue); n != 0 {
			t.Errorf("%d tasks in the queue, want 0", n)
		}
	})

	t.Run("more bad lines than are shown", func(t *testing.T) {
		queue := redistest.Queue(t, "bad")
		path := writeLines(t, 100, func(i int) string {
			if i%2 == 0 {
				return `{"type": "demo:sleep"}`
			}
			return sleepLine(i)
		})
		r := runEnqueue(t, addr, nil, "--config", enqueueConfig(t, queue), "--queue", queue, "--file", path)
		if r.code != 2 || !strings.Contains(r.stderr, "has 50 bad lines;") || !strings.Contains(r.stderr, "line 40: ") ||
			strings.Contains(r.stderr, "line 42: ") || !strings.Contains(r.stderr, "and 30 more") {
			t.Errorf("want exit 2, the first 20 bad lines (2 to 40) and \"and 30 more\"\n%v", r)
		}
	})
}

// TestEnqueueOne: one task with every option lands with those options set,
// and its id is printed; a queue the config does not name gets a warning.
func TestEnqueueOne(t *testing.T) {
	t.Parallel()
	addr := redistest.Addr(t)
	queue := redistest.Queue(t, "one")
	config := enqueueConfig(t, queue)
	inspector := asynq.NewInspector(asynq.RedisClientOpt{Addr: addr})
	defer inspector.Close()

	r := runEnqueue(t, addr, nil, "--config", config, "--queue", queue, "demo:sleep", `{"ms": 10}`,
		"--max-retry", "3", "--timeout", "45s", "--process-in", "1h", "--retention", "2h")
	if r.code != 0 || strings.Count(r.stdout, "\n") != 1 || strings.Contains(r.stderr, "warning") {
		t.Fatalf("want exit 0, one id and no warning\n%v", r)
	}
	info, err := inspector.GetTaskInfo(queue, strings.TrimSpace(r.stdout))
	if err != nil {
		t.Fatal(err)
	}
	if info.Type != "demo:sleep" || string(info.Payload) != `{"ms":10}` || info.MaxRetry != 3 || info.Timeout != 45*time.Second ||
		info.Retention != 2*time.Hour || info.State != asynq.TaskStateScheduled ||
		info.NextProcessAt.Before(time.Now().Add(59*time.Minute)) || info.NextProcessAt.After(time.Now().Add(61*time.Minute)) {
		t.Errorf("task %+v; want demo:sleep {\"ms\":10}, MaxRetry 3, Timeout 45s, Retention 2h, scheduled in 1h", info)
	}

	deadline := time.Now().Add(3 * time.Hour).UTC().Truncate(time.Second)
	r = runEnqueue(t, addr, nil, "--config", config, "--queue", queue, "http:request", `{"url": "http://127.0.0.1/x"}`,
		"--task-id", "my-task", "--deadline", deadline.Format(time.RFC3339), "--group", "batch-1")
	if r.code != 0 || r.stdout != "my-task\n" {
		t.Fatalf("want exit 0 and the id my-task\n%v", r)
	}
	info, err = inspector.GetTaskInfo(queue, "my-task")
	if err != nil {
		t.Fatal(err)
	}
	if !info.Deadline.Equal(deadline) || info.Group != "batch-1" || info.State != asynq.TaskStateAggregating || info.MaxRetry != 25 {
		t.Errorf("task %+v; want Deadline %v, Group batch-1, aggregating, MaxRetry 25 (asynq's default)", info, deadline)
	}

	// The same task id again: already enqueued, not an error.
	r = runEnqueue(t, addr, nil, "--config", config, "--queue", queue, "demo:noop", "--task-id", "my-task")
	if r.code != 0 || r.stdout != "my-task\n" || !strings.Contains(r.stderr, "already enqueued") {
		t.Errorf("same task id again: want exit 0, the id and \"already enqueued\"\n%v", r)
	}
	if n := queueSize(t, addr, queue); n != 2 {
		t.Errorf("%d tasks in the queue, want 2", n)
	}

	other := redistest.Queue(t, "unconfigured")
	r = runEnqueue(t, addr, nil, "--config", config, "--queue", other, "demo:noop")
	if r.code != 0 || !strings.Contains(r.stderr, fmt.Sprintf("warning: queue %q", other)) || queueSize(t, addr, other) != 1 {
		t.Errorf("a queue not in the config: want the task enqueued with a warning\n%v", r)
	}
}

// TestEnqueueCount: --count 5 prints five different ids, all in the queue.
func TestEnqueueCount(t *testing.T) {
	t.Parallel()
	addr := redistest.Addr(t)
	queue := redistest.Queue(t, "count")
	r := runEnqueue(t, addr, nil, "--config", enqueueConfig(t, queue), "--queue", queue, "--count", "5", "demo:noop")
	ids := strings.Fields(r.stdout)
	if r.code != 0 || len(ids) != 5 || len(slices.Compact(slices.Sorted(slices.Values(ids)))) != 5 {
		t.Fatalf("want exit 0 and 5 different ids\n%v", r)
	}
	inspector := asynq.NewInspector(asynq.RedisClientOpt{Addr: addr})
	defer inspector.Close()
	for _, id := range ids {
		if _, err := inspector.GetTaskInfo(queue, id); err != nil {
			t.Errorf("task %s: %v", id, err)
		}
	}
	if n := queueSize(t, addr, queue); n != 5 {
		t.Errorf("%d tasks in the queue, want 5", n)
	}
}

// TestEnqueueFile: 1,000 lines (a blank one among them) enqueue 1,000
// tasks; lines with a queue of their own go there.
func TestEnqueueFile(t *testing.T) {
	t.Parallel()
	addr := redistest.Addr(t)
	queue, other := redistest.Queue(t, "file"), redistest.Queue(t, "other")
	path := writeLines(t, 1001, func(i int) string {
		switch {
		case i == 301:
			return "   "
		case i%10 == 0:
			return fmt.Sprintf(`{"type": "demo:sleep", "payload": {"ms": %d}, "queue": %q, "options": {"max_retry": 1}}`, i, other)
		}
		return fmt.Sprintf(`{"type": "http:request", "payload": {"url": "http://127.0.0.1/%d"}}`, i)
	})
	r := runEnqueue(t, addr, nil, "--config", enqueueConfig(t, queue, other), "--queue", queue, "--file", path)
	if r.code != 0 || !strings.Contains(r.stdout, "1000 tasks") || !strings.Contains(r.stdout, "1000 enqueued") {
		t.Fatalf("want exit 0 and 1000 enqueued\n%v", r)
	}
	if a, b := queueSize(t, addr, queue), queueSize(t, addr, other); a != 900 || b != 100 {
		t.Errorf("%d and %d tasks in the queues, want 900 and 100", a, b)
	}
}

// TestEnqueueFileTwice: a file whose lines have task ids, enqueued twice
// (the second time from stdin), gives each task once; the second run says
// they were already enqueued and succeeds.
func TestEnqueueFileTwice(t *testing.T) {
	t.Parallel()
	addr := redistest.Addr(t)
	queue := redistest.Queue(t, "twice")
	config := enqueueConfig(t, queue)
	path := writeLines(t, 1000, func(i int) string {
		return fmt.Sprintf(`{"type": "demo:noop", "options": {"task_id": "line-%d"}}`, i)
	})
	r := runEnqueue(t, addr, nil, "--config", config, "--queue", queue, "--file", path)
	if r.code != 0 || !strings.Contains(r.stdout, "1000 enqueued") {
		t.Fatalf("first run: want exit 0 and 1000 enqueued\n%v", r)
	}
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	r = runEnqueue(t, addr, f, "--config", config, "--queue", queue, "--file", "-")
	if r.code != 0 || !strings.Contains(r.stdout, "0 enqueued, 1000 already enqueued") {
		t.Errorf("second run: want exit 0 and 1000 already enqueued\n%v", r)
	}
	if n := queueSize(t, addr, queue); n != 1000 {
		t.Errorf("%d tasks in the queue, want 1000", n)
	}
}

// TestEnqueueFileSkip: --skip 40 of 100 lines enqueues lines 41 to 100.
func TestEnqueueFileSkip(t *testing.T) {
	t.Parallel()
	addr := redistest.Addr(t)
	queue := redistest.Queue(t, "skip")
	path := writeLines(t, 100, func(i int) string {
		return fmt.Sprintf(`{"type": "demo:noop", "options": {"task_id": "line-%d"}}`, i)
	})
	r := runEnqueue(t, addr, nil, "--config", enqueueConfig(t, queue), "--queue", queue, "--file", path, "--skip", "40")
	if r.code != 0 || !strings.Contains(r.stdout, "60 enqueued") {
		t.Fatalf("want exit 0 and 60 enqueued\n%v", r)
	}
	inspector := asynq.NewInspector(asynq.RedisClientOpt{Addr: addr})
	defer inspector.Close()
	for _, line := range []int{40, 41, 100} {
		_, err := inspector.GetTaskInfo(queue, fmt.Sprintf("line-%d", line))
		if in := err == nil; in != (line > 40) {
			t.Errorf("line %d in the queue: %v (%v), want %v", line, in, err, line > 40)
		}
	}
	if n := queueSize(t, addr, queue); n != 60 {
		t.Errorf("%d tasks in the queue, want 60", n)
	}
	r = runEnqueue(t, addr, nil, "--config", enqueueConfig(t, queue), "--queue", queue, "--file", path, "--skip", "101")
	if r.code != 2 || !strings.Contains(r.stderr, "has only 100 lines") {
		t.Errorf("--skip past the end: want exit 2 and a message\n%v", r)
	}
}

// statusDoc is the part of `enqueue status --json` the tests read.
type statusDoc struct {
	Queues  []statusQueue
	Quotas  []statusGate
	Workers []struct {
		Host string
		PID  int
	}
}

type statusQueue struct {
	Name                                        string
	Configured                                  bool
	Pending, Scheduled, Retry, Active, Archived int
	Waiting                                     int // for their turn, in Redis
	Drain                                       *statusGate
	RatePerSecond                               float64 `json:"rate_per_second"`
}

type statusGate struct {
	Name, Algorithm, Period       string
	Limit, Burst, Level, Capacity int
}

func (d statusDoc) queue(t *testing.T, name string) statusQueue {
	t.Helper()
	i := slices.IndexFunc(d.Queues, func(q statusQueue) bool { return q.Name == name })
	if i < 0 {
		t.Fatalf("status does not list queue %s", name)
	}
	return d.Queues[i]
}

// TestEnqueueStatus: status --json lists the test's queue with its counts
// and drain, its quota at full level, and a queue the config does not name.
func TestEnqueueStatus(t *testing.T) {
	t.Parallel()
	addr := redistest.Addr(t)
	queue, other, quota := redistest.Queue(t, "status"), redistest.Queue(t, "other"), redistest.Queue(t, "api")
	config := writeConfig(t, fmt.Sprintf(`
redis: {addr: 127.0.0.1:1}
queues:
  %s: {drain: {algorithm: token_bucket, limit: 30, period: 1m, burst: 7}}
quotas:
  %s: {limit: 10, period: 1s, burst: 4}
tasks:
  http:request: {quotas: [%s]}
`, queue, quota, quota))
	for _, args := range [][]string{
		{"--queue", queue, "--count", "3", "demo:noop"},
		{"--queue", queue, "--count", "2", "--process-in", "1h", "demo:noop"},
		{"--queue", other, "demo:noop"},
	} {
		if r := runEnqueue(t, addr, nil, append([]string{"--config", config}, args...)...); r.code != 0 {
			t.Fatalf("enqueue %q:\n%v", args, r)
		}
	}
	r := runEnqueue(t, addr, nil, "--config", config, "status", "--json")
	var doc statusDoc
	if err := json.Unmarshal([]byte(r.stdout), &doc); r.code != 0 || err != nil {
		t.Fatalf("status --json: %v\n%v", err, r)
	}
	q := doc.queue(t, queue)
	if !q.Configured || q.Pending != 3 || q.Scheduled != 2 || q.Retry != 0 || q.Active != 0 || q.Archived != 0 {
		t.Errorf("queue %+v; want configured, 3 pending, 2 scheduled", q)
	}
	if d := q.Drain; d == nil || d.Algorithm != "token_bucket" || d.Limit != 30 || d.Period != "1m" || d.Burst != 7 || d.Level != 7 || d.Capacity != 7 {
		t.Errorf("drain %+v; want token_bucket 30/1m burst 7, level 7 of 7", d)
	}
	if o := doc.queue(t, other); o.Configured || o.Pending != 1 || o.Drain != nil {
		t.Errorf("unconfigured queue %+v; want not configured, 1 pending, no drain", o)
	}
	if len(doc.Quotas) != 1 || doc.Quotas[0].Name != quota || doc.Quotas[0].Limit != 10 || doc.Quotas[0].Level != 4 || doc.Quotas[0].Capacity != 4 {
		t.Errorf("quotas %+v; want %s, limit 10, level 4 of 4", doc.Quotas, quota)
	}

	r = runEnqueue(t, addr, nil, "--config", config, "status")
	if r.code != 0 || !strings.Contains(r.stdout, queue) || !strings.Contains(r.stdout, "token_bucket 30/1m burst 7") {
		t.Errorf("status: want a table naming the queue and its drain\n%v", r)
	}
}

// TestEnqueueStatusWatch: status --watch --json prints a document a second
// until interrupted, and exits 0.
func TestEnqueueStatusWatch(t *testing.T) {
	t.Parallel()
	cmd := exec.Command(filepath.Join(bin, "enqueue"), "--config", enqueueConfig(t), "status", "--watch", "--json")
	cmd.Env = append(os.Environ(), "SLUICE_REDIS_ADDR="+redistest.Addr(t))
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	pipe, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	// Wait for two documents rather than a fixed time: on 2 busy cores the
	// process's start alone can take most of a second.
	docs := make(chan string)
	go func() {
		defer close(docs)
		sc := bufio.NewScanner(pipe)
		for sc.Scan() {
			docs <- sc.Text()
		}
	}()
	var lines []string
	deadline := time.After(15 * time.Second)
	for len(lines) < 2 {
		select {
		case line, ok := <-docs:
			if !ok {
				t.Fatalf("status --watch ended after %d documents: %v\n%s", len(lines), cmd.Wait(), stderr.String())
			}
			lines = append(lines, line)
		case <-deadline:
			cmd.Process.Kill()
			t.Fatalf("%d documents in 15 s, want at least 2", len(lines))
		}
	}
	cmd.Process.Signal(os.Interrupt)
	for line := range docs {
		lines = append(lines, line)
	}
	if err := cmd.Wait(); err != nil {
		t.Fatalf("status --watch after Ctrl-C: %v\n%s", err, stderr.String())
	}
	for _, line := range lines {
		var doc statusDoc
		if err := json.Unmarshal([]byte(line), &doc); err != nil {
			t.Errorf("line %q: %v", line, err)
		}
	}
}

// TestEnqueueFileRedisFailure: a redis-server of the test's own (append
// only, fsync always) is killed part way through a 100,000-line load. The
// report's line ranges cover every line once; after a restart, every line
// reported in Redis is there, none reported not enqueued is, and the
// uncertain ones are either. Resuming with the --skip it suggests then
// completes the load without duplicates.
func TestEnqueueFileRedisFailure(t *testing.T) {
	const lines = 100_000
	srv := redistest.StartServer(t) // append only, fsync always: what it acknowledged survives a kill -9
	addr := srv.Addr
	queue := redistest.Queue(t, "kill")
	config := enqueueConfig(t, queue)
	path := writeLines(t, lines, func(i int) string {
		return fmt.Sprintf(`{"type": "demo:noop", "options": {"task_id": "line-%d"}}`, i)
	})

	cmd := exec.Command(filepath.Join(bin, "enqueue"), "--config", config, "--queue", queue, "--file", path)
	cmd.Env = append(os.Environ(), "SLUICE_REDIS_ADDR="+addr)
	var stdout bytes.Buffer
	cmd.Stdout = &stdout
	pipe, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	var stderr strings.Builder
	progress := regexp.MustCompile(fmt.Sprintf(`^enqueue: \d+/%d enqueued`, lines))
	killed := false
	sc := bufio.NewScanner(pipe)
	for sc.Scan() {
		stderr.WriteString(sc.Text() + "\n")
		if !killed && progress.MatchString(sc.Text()) {
			srv.Kill()
			killed = true
		}
	}
	cmd.Wait()
	r := enqueueRun{stdout: stdout.String(), stderr: stderr.String(), code: cmd.ProcessState.ExitCode()}
	if !killed {
		t.Fatalf("the load ended before its first progress line\n%v", r)
	}
	t.Logf("report:\n%s", r.stderr)
	if r.code != 1 {
		t.Fatalf("exit code %d, want 1\n%v", r.code, r)
	}

	// The ranges cover every line exactly once, and agree with their counts.
	report := regexp.MustCompile(`(?m)^\s+(in Redis|uncertain|not enqueued):\s+lines ([0-9, -]+) \((\d+)\)`)
	state := make([]string, lines+1)
	count := map[string]int{}
	for _, m := range report.FindAllStringSubmatch(r.stderr, -1) {
		n := 0
		for _, span := range strings.Split(m[2], ", ") {
			first, last, _ := strings.Cut(span, "-")
			a, _ := strconv.Atoi(first)
			b := a
			if last != "" {
				b, _ = strconv.Atoi(last)
			}
			for line := a; line <= b; line++ {
				if state[line] != "" {
					t.Fatalf("line %d is both %s and %s", line, state[line], m[1])
				}
				state[line] = m[1]
				n++
			}
		}
		if want, _ := strconv.Atoi(m[3]); n != want {
			t.Errorf("%s: the ranges hold %d lines, the count says %d", m[1], n, want)
		}
		count[m[1]] = n
	}
	if i := slices.Index(state[1:], ""); i >= 0 {
		t.Fatalf("line %d is in no range of the report", i+1)
	}
	if count["in Redis"] == 0 || count["not enqueued"] == 0 || count["uncertain"] > 32 {
		t.Errorf("counts %v; want some lines in Redis, some not, and at most 32 (the pool) uncertain", count)
	}
	m := regexp.MustCompile(`--skip (\d+)`).FindStringSubmatch(r.stderr)
	if m == nil {
		t.Fatalf("no --skip hint in the report")
	}
	skip, _ := strconv.Atoi(m[1])
	if state[skip] != "in Redis" || state[skip+1] == "in Redis" {
		t.Errorf("--skip %d: want the lines before the first line not surely in Redis", skip)
	}

	// After a restart, Redis holds what the report says.
	srv.Start(t)
	ids := taskIDs(t, addr, queue)
	uncertainLanded := 0
	for line := 1; line <= lines; line++ {
		in := ids[fmt.Sprintf("line-%d", line)]
		switch {
		case state[line] == "in Redis" && !in:
			t.Errorf("line %d: reported in Redis, not there after the restart", line)
		case state[line] == "not enqueued" && in:
			t.Errorf("line %d: reported not enqueued, there after the restart", line)
		case state[line] == "uncertain" && in:
			uncertainLanded++
		}
	}
	t.Logf("%d in Redis, %d uncertain of which %d had landed, %d not enqueued; %d tasks after the restart",
		count["in Redis"], count["uncertain"], uncertainLanded, count["not enqueued"], len(ids))
	if len(ids) != count["in Redis"]+uncertainLanded {
		t.Errorf("%d tasks after the restart, want %d", len(ids), count["in Redis"]+uncertainLanded)
	}

	// Resume as the report says: everything once.
	r = runEnqueue(t, addr, nil, "--config", config, "--queue", queue, "--file", path, "--skip", m[1])
	if r.code != 0 || !strings.Contains(r.stdout, fmt.Sprintf("%d tasks", lines-skip)) {
		t.Errorf("resuming with --skip %d: want exit 0\n%v", skip, r)
	}
	if n := len(taskIDs(t, addr, queue)); n != lines {
		t.Errorf("%d tasks after resuming, want %d", n, lines)
	}
}

// TestEnqueueFileMemory (9.8): the memory `enqueue --file` needs does not
// grow with the file. A file of 100 MB of good lines is checked in full
// and refused for its last line; the check held no task, so the process
// peaked far below the file's size. Then the same lines, a fifth of them,
// are loaded: loading holds a bounded batch, not the file.
func TestEnqueueFileMemory(t *testing.T) {
	addr := redistest.Addr(t)
	queue := redistest.Queue(t, "memory")
	body := strings.Repeat("x", 1000)
	line := func(i int) string {
		return fmt.Sprintf(`{"type": "http:request", "payload": {"url": "http://127.0.0.1/%d", "method": "POST", "body": %q}}`, i, body)
	}
	const lines = 100_000 // about 1,100 bytes each
	path := writeLines(t, lines, func(i int) string {
		if i == lines {
			return `{"type": "demo:sleep", "payload": {"ms": -1}}`
		}
		return line(i)
	})
	r := runEnqueue(t, addr, nil, "--config", enqueueConfig(t, queue), "--queue", queue, "--file", path)
	peak := r.peakRSS
	if r.code != 2 || !strings.Contains(r.stderr, fmt.Sprintf("line %d: ", lines)) {
		t.Fatalf("want exit 2 naming line %d\n%v", lines, r)
	}
	t.Logf("checking a %d MB file: peak RSS %d MB", fileMB(t, path), peak>>20)
	if peak > 60<<20 {
		t.Errorf("checking a %d MB file peaked at %d MB RSS, want under 60 MB: memory grows with the file", fileMB(t, path), peak>>20)
	}

	const loaded = 20_000
	path = writeLines(t, loaded, line)
	r = runEnqueue(t, addr, nil, "--config", enqueueConfig(t, queue), "--queue", queue, "--file", path)
	peak = r.peakRSS
	if r.code != 0 || !strings.Contains(r.stdout, fmt.Sprintf("%d enqueued", loaded)) {
		t.Fatalf("want exit 0 and %d enqueued\n%v", loaded, r)
	}
	t.Logf("loading a %d MB file: peak RSS %d MB", fileMB(t, path), peak>>20)
	if peak > 60<<20 {
		t.Errorf("loading a %d MB file peaked at %d MB RSS, want under 60 MB", fileMB(t, path), peak>>20)
	}
	if n := queueSize(t, addr, queue); n != loaded {
		t.Errorf("%d tasks in the queue, want %d", n, loaded)
	}
	deleteQueue(t, addr, queue)
}

// TestEnqueueInputLimits (9.8): a byte-order mark before the first line is
// skipped; an absurd --count is refused before anything is allocated.
func TestEnqueueInputLimits(t *testing.T) {
	t.Parallel()
	addr := redistest.Addr(t)
	queue := redistest.Queue(t, "limits")
	config := enqueueConfig(t, queue)
	path := filepath.Join(t.TempDir(), "bom.jsonl")
	if err := os.WriteFile(path, []byte("\xEF\xBB\xBF"+`{"type": "demo:noop"}`+"\n"+`{"type": "demo:noop"}`+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if r := runEnqueue(t, addr, nil, "--config", config, "--queue", queue, "--file", path); r.code != 0 || !strings.Contains(r.stdout, "2 enqueued") {
		t.Errorf("a file that starts with a UTF-8 BOM: want exit 0 and 2 enqueued\n%v", r)
	}
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if r := runEnqueue(t, addr, f, "--config", config, "--queue", queue, "--file", "-"); r.code != 0 || !strings.Contains(r.stdout, "2 enqueued") {
		t.Errorf("the same on stdin: want exit 0 and 2 enqueued\n%v", r)
	}
	for _, count := range []string{"2000000000", "1000001"} {
		r := runEnqueue(t, addr, nil, "--config", config, "--queue", queue, "--count", count, "demo:noop")
		if r.code != 2 || !strings.Contains(r.stderr, "--count must be at most 1,000,000, got "+count) {
			t.Errorf("--count %s: want exit 2 and a message naming the maximum\n%v", count, r)
		}
	}
	if n := queueSize(t, addr, queue); n != 4 {
		t.Errorf("%d tasks in the queue, want 4", n)
	}
}
