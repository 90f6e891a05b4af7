package producer_test

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/config"
	"github.com/sluicehq/sluice/internal/redistest"
	"github.com/sluicehq/sluice/internal/testkit"
	"github.com/sluicehq/sluice/producer"
)

// payloads is the config the tests check payloads with: the built-in
// types only.
func payloads(t *testing.T) config.File {
	t.Helper()
	path := filepath.Join(t.TempDir(), "config.yaml")
	if err := os.WriteFile(path, []byte("redis: {addr: 127.0.0.1:6379}\nqueues:\n  default: {}\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	f, err := config.Load(path)
	if err != nil {
		t.Fatal(err)
	}
	return f
}

func ptr[T any](v T) *T { return &v }

// TestDecodeLine: a line's own queue and options win over the defaults
// (a line's process_in replaces a default process_at), and each kind of
// mistake is reported naming its key or byte, with every bad option of a
// line reported, not the first only.
func TestDecodeLine(t *testing.T) {
	now := time.Date(2030, 1, 2, 15, 4, 5, 0, time.UTC)
	d := producer.Defaults{Queue: "bulk", Options: producer.Options{MaxRetry: ptr(7), ProcessAt: ptr("2030-01-03T00:00:00Z")}, Payloads: payloads(t)}
	for _, c := range []struct {
		desc  string
		line  string
		queue string
		id    string
		want  string // in the error; "" for none
	}{
		{desc: "the defaults", line: `{"type": "demo:noop"}`, queue: "bulk"},
		{desc: "its own queue and options", line: `{"type": "demo:sleep", "payload": {"ms": 5}, "queue": "emails", "options": {"process_in": "5m", "task_id": "a-1"}}`, queue: "emails", id: "a-1"},
		{desc: "null payload and options", line: `{"type": "demo:noop", "payload": null, "options": null}`, queue: "bulk"},
		{desc: "no type", line: `{"payload": {}}`, want: `"type" is required: a task type, one of`},
		{desc: "an unknown key", line: `{"type": "demo:noop", "priority": 3}`, want: `unknown key "priority"; the keys of a line are type, payload, queue, options`},
		{desc: "an unknown option", line: `{"type": "demo:noop", "options": {"retries": 3}}`, want: `options: unknown option "retries"`},
		{desc: "an option of the wrong type", line: `{"type": "demo:noop", "options": {"max_retry": "3"}}`, want: "options.max_retry: want a whole number, got string"},
		{desc: "two bad options", line: `{"type": "demo:noop", "options": {"max_retry": -1, "timeout": "1.5s"}}`, want: "options.max_retry: must be >= 0, got -1\noptions.timeout: must be a whole number of seconds"},
		{desc: "both times to run", line: `{"type": "demo:noop", "options": {"process_in": "1m", "process_at": "2030-01-03T00:00:00Z"}}`, want: "options.process_in: cannot be used with options.process_at"},
		{desc: "a deadline past", line: `{"type": "demo:noop", "options": {"deadline": "2030-01-01T00:00:00Z"}}`, want: "options.deadline: 2030-01-01T00:00:00Z is not in the future"},
		{desc: "a task id too long", line: fmt.Sprintf(`{"type": "demo:noop", "options": {"task_id": %q}}`, strings.Repeat("x", producer.MaxTaskID+1)), want: "options.task_id: is 1025 bytes long; task ids are at most 1024 bytes"},
		{desc: "an upper-case queue, kept as written", line: `{"type": "demo:noop", "queue": "Emails"}`, queue: "Emails"},
		{desc: "a brace in a queue", line: `{"type": "demo:noop", "queue": "e{mails}"}`, want: `queue: "e{mails}": queue names are letters, digits`},
		{desc: "a payload against its type", line: `{"type": "demo:sleep", "payload": {"ms": "long"}}`, want: `demo:sleep: payload: field "ms"`},
		{desc: "two objects", line: `{"type": "demo:noop"} {}`, want: "invalid JSON at byte 22: data after the object (one task per line)"},
		{desc: "cut short", line: `{"type": "demo:no`, want: "invalid JSON at byte 17: unexpected end of line"},
	} {
		task, err := producer.DecodeLine([]byte(c.line), d, now)
		switch {
		case c.want == "" && err != nil:
			t.Errorf("%s: %v", c.desc, err)
		case c.want != "" && (err == nil || !strings.Contains(err.Error(), c.want)):
			t.Errorf("%s: error %v, want one saying %q", c.desc, err, c.want)
		case c.want == "" && (task.Queue != c.queue || task.TaskID != c.id):
			t.Errorf("%s: queue %q, task id %q; want %q, %q", c.desc, task.Queue, task.TaskID, c.queue, c.id)
		}
	}
}

// TestOptionsOver: a line's process_in replaces a default process_at (one
// setting, when to run), and options the line does not set keep the
// defaults'.
func TestOptionsOver(t *testing.T) {
	base := producer.Options{ProcessAt: ptr("2030-01-03T00:00:00Z"), MaxRetry: ptr(7), Group: ptr("g")}
	got := base.Over(producer.Options{ProcessIn: ptr("5m"), Group: ptr("h")})
	if got.ProcessAt != nil || *got.ProcessIn != "5m" || *got.MaxRetry != 7 || *got.Group != "h" {
		t.Errorf("Over: %+v, want process_in 5m, no process_at, max_retry 7, group h", got)
	}
}

// writeLines writes lines to a file of the test's own and opens it.
func writeLines(t *testing.T, lines ...string) *os.File {
	t.Helper()
	path := filepath.Join(t.TempDir(), "tasks.jsonl")
	if err := os.WriteFile(path, []byte(strings.Join(lines, "\n")+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	f, err := producer.OpenFile(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	return f
}

// TestCheckTasks: a file's tasks are counted by queue past its skipped and
// blank lines; a task id given twice in one queue is a bad line naming
// the first, and so is every other bad line, each by its number.
func TestCheckTasks(t *testing.T) {
	d := producer.Defaults{Queue: "bulk", Payloads: payloads(t)}
	known := func(q string) bool { return q == "bulk" }
	now := time.Now()
	f := writeLines(t, "\xEF\xBB\xBF"+`{"type": "not-counted"}`, `{"type": "demo:noop"}`, ``, `{"type": "demo:noop", "queue": "other"}`, `{"type": "demo:noop"}`)
	c, err := producer.CheckTasks(f, "tasks.jsonl", 1, d, now, known)
	if err != nil {
		t.Fatal(err)
	}
	if c.Tasks != 3 || c.LastLine != 5 || c.Queues["bulk"] != 2 || c.Queues["other"] != 1 || c.More != 0 {
		t.Errorf("CheckTasks: %+v, want 3 tasks to line 5, 2 in bulk and 1 in other", c)
	}

	f = writeLines(t, `{"type": "demo:noop", "options": {"task_id": "a"}}`, `{"type": "demo:noop", "queue": "other", "options": {"task_id": "a"}}`,
		`{"type": "nope"}`, `{"type": "demo:noop", "options": {"task_id": "a"}}`)
	_, err = producer.CheckTasks(f, "tasks.jsonl", 0, d, now, known)
	want := "tasks.jsonl has 2 bad lines; nothing was enqueued:\n  line 3: "
	if err == nil || !strings.HasPrefix(err.Error(), want) ||
		!strings.HasSuffix(err.Error(), "\n  line 4: task_id \"a\" is also on line 1 in queue \"bulk\": a task id is taken once per queue") {
		t.Errorf("CheckTasks of a file with a bad type and a task id twice in bulk: %v\nwant lines 3 and 4 named, in order", err)
	}

	f = writeLines(t, `{"type": "demo:noop"}`)
	if _, err := producer.CheckTasks(f, "tasks.jsonl", 3, d, now, known); err == nil || err.Error() != "--skip 3: tasks.jsonl has only 1 lines" {
		t.Errorf("skipping past the end: %v", err)
	}
}

// loaderClient is a client of the standalone server as enqueue makes
// one for a Loader: a pool of LoadPool, no retries, one dial.
func loaderClient(t *testing.T, addr string) *redis.Client {
	rdb := redis.NewClient(&redis.Options{Addr: addr, PoolSize: producer.LoadPool, MaxRetries: -1, DialerRetries: 1})
	t.Cleanup(func() { rdb.Close() })
	return rdb
}

// TestLoadFile loads a file checked by CheckTasks through a Loader, as
// enqueue --file does, into a queue of the test's own, on a standalone
// server and on the cluster: every task lands, each reported in order
// with its line; loaded again, the line with a task_id counts as already
// enqueued and the others land twice.
func TestLoadFile(t *testing.T) { onBothBackends(t, testLoadFile) }

// onBothBackends runs test as a subtest on the standalone Redis and on the
// cluster, each with a loader's client (see loaderClient) and the asynq
// options to read what it loaded.
func onBothBackends(t *testing.T, test func(*testing.T, redis.UniversalClient, asynq.RedisConnOpt)) {
	t.Run("standalone", func(t *testing.T) {
		test(t, loaderClient(t, redistest.Addr(t)), asynq.RedisClientOpt{Addr: redistest.Addr(t)})
	})
	t.Run("cluster", func(t *testing.T) {
		rdb := redis.NewClusterClient(&redis.ClusterOptions{Addrs: redistest.ClusterAddrs(t), PoolSize: producer.LoadPool, MaxRetries: -1, DialerRetries: 1})
		t.Cleanup(func() { rdb.Close() })
		test(t, rdb, asynq.RedisClusterClientOpt{Addrs: redistest.ClusterAddrs(t)})
	})
}

func testLoadFile(t *testing.T, rdb redis.UniversalClient, opt asynq.RedisConnOpt) {
	queue := redistest.Queue(t, "load")
	inspector := asynq.NewInspector(opt)
	defer inspector.Close()
	t.Cleanup(func() { inspector.DeleteQueue(queue, true) })
	const tasks = 10_000 // more than one batch of Load (4096)
	lines := make([]string, 0, tasks+1)
	lines = append(lines, `{"type": "demo:noop", "options": {"task_id": "first"}}`, ``)
	for i := 1; i < tasks; i++ {
		lines = append(lines, fmt.Sprintf(`{"type": "demo:sleep", "payload": {"ms": %d}}`, i))
	}
	f := writeLines(t, lines...)
	d := producer.Defaults{Queue: queue, Payloads: payloads(t)}
	now := time.Now()
	c, err := producer.CheckTasks(f, "tasks.jsonl", 0, d, now, func(string) bool { return true })
	if err != nil || c.Tasks != tasks {
		t.Fatalf("CheckTasks: %+v %v, want %d tasks", c, err, tasks)
	}
	loader := producer.NewLoader(rdb)
	load := func() *producer.Tally {
		t.Helper()
		if _, err := f.Seek(0, io.SeekStart); err != nil {
			t.Fatal(err)
		}
		y := producer.NewTally()
		lastLine := 0
		err := loader.Load(context.Background(), producer.FileTasks(f, "tasks.jsonl", 0, d, now), nil, func(task producer.Task, r producer.Result) {
			if task.Line <= lastLine {
				t.Fatalf("line %d reported after line %d", task.Line, lastLine)
			}
			lastLine = task.Line
			y.Add(task, r)
		})
		if err != nil {
			t.Fatal(err)
		}
		return y
	}
	y := load()
	if y.Tasks() != tasks || y.Count(producer.Enqueued) != tasks || y.Landed() != tasks {
		t.Errorf("first load: %d tasks, %d enqueued, %d landed; want %d each", y.Tasks(), y.Count(producer.Enqueued), y.Landed(), tasks)
	}
	y = load()
	if y.Count(producer.Existed) != 1 || y.Count(producer.Enqueued) != tasks-1 || y.AlreadyThere() != ", 1 already enqueued (their task_id was taken)" {
		t.Errorf("second load: %d existed, %d enqueued (%q); want 1 and %d", y.Count(producer.Existed), y.Count(producer.Enqueued), y.AlreadyThere(), tasks-1)
	}
	if info, err := inspector.GetQueueInfo(queue); err != nil || info.Pending != 2*tasks-1 {
		t.Errorf("queue %s: %+v %v, want %d pending tasks", queue, info, err, 2*tasks-1)
	}
}

// TestLoaderUncertain: a task whose write reached Redis but whose reply
// was lost is Uncertain (it is in Redis), not Refused; with Redis gone
// (connection refused), a task is Refused, and Load stops at once: at
// most LoadPool tasks are tried, the rest are NotTried. The tally's report names the lines of each
// outcome and where to resume.
func TestLoaderUncertain(t *testing.T) {
	queue := redistest.Queue(t, "uncertain")
	inspector := asynq.NewInspector(asynq.RedisClientOpt{Addr: redistest.Addr(t)})
	defer inspector.Close()
	t.Cleanup(func() { inspector.DeleteQueue(queue, true) })
	proxy := redistest.NewProxy(t, redistest.Addr(t))
	rdb := loaderClient(t, proxy.Addr)
	loader := producer.NewLoader(rdb)
	if err := rdb.Ping(context.Background()).Err(); err != nil { // the connection the lost reply will be on
		t.Fatal(err)
	}
	check := payloads(t)
	task := func(line int) producer.Task {
		task, err := producer.NewTask("demo:noop", nil, queue, producer.CheckedOptions{}, check)
		if err != nil {
			t.Fatal(err)
		}
		task.Line = line
		return task
	}

	y := producer.NewTally()
	// The first task of a queue also registers the queue (a SADD): the
	// reply lost is the second's, to the script that writes it.
	r := loader.Enqueue(task(1))
	y.Add(task(1), r)
	if r.Outcome != producer.Enqueued || r.ID == "" {
		t.Fatalf("the first task: %+v, want Enqueued with its id", r)
	}
	proxy.LoseReplies(1)
	r = loader.Enqueue(task(2))
	y.Add(task(2), r)
	if r.Outcome != producer.Uncertain || r.Err == nil {
		t.Fatalf("a task whose reply was lost: %+v, want Uncertain with its error", r)
	}
	if info := redistest.QueueInfo(t, queue); info.Pending != 2 {
		t.Errorf("after the uncertain task: %d pending, want 2 (its write ran)", info.Pending)
	}

	// A server that is gone: the write is never sent.
	gone := testkit.FreeAddr(t)
	line := 2
	err := producer.NewLoader(loaderClient(t, gone)).Load(context.Background(), func() (producer.Task, bool, error) {
		line++
		return task(line), line <= 10_000, nil
	}, nil, func(task producer.Task, r producer.Result) {
		y.Add(task, r)
	})
	if err != nil {
		t.Fatal(err)
	}
	// The pool's goroutines each take a task before they see the first
	// failure: at most LoadPool are tried.
	refused, notTried := y.Count(producer.Refused), y.Count(producer.NotTried)
	if refused < 1 || refused > producer.LoadPool || refused+notTried != 10_000-2 || y.Count(producer.Uncertain) != 1 {
		t.Errorf("a load with Redis gone: %d refused, %d not tried, %d uncertain; want 1 to %d refused, the rest of the 9,998 not tried, and only the earlier task uncertain",
			refused, notTried, y.Count(producer.Uncertain), producer.LoadPool)
	}
	report := y.FileFailure("tasks.jsonl", "Redis at "+gone, nil).Error()
	for _, want := range []string{
		"Redis at " + gone + " failed part way: ",
		"tasks.jsonl: 1 of 10000 tasks are in Redis\n",
		"  in Redis:     lines 1 (1)\n",
		"  uncertain:    lines 2 (1): sent, but the connection broke before Redis answered",
		"  not enqueued: lines 3-10000 (9998)\n",
		"to resume, run the same command with --skip 1 (the lines before line 2, the first that is not surely in Redis)",
		"warning: these lines from line 2 on are or may be in Redis and have no task_id, so resuming would enqueue them again: 2 (1)",
	} {
		if !strings.Contains(report, want) {
			t.Errorf("the report lacks %q:\n%s", want, report)
		}
	}
}
