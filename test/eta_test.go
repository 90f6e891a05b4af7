package test

import (
	"encoding/json"
	"fmt"
	"math"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/sluicehq/sluice/internal/redistest"
	"github.com/sluicehq/sluice/internal/testkit"
)

// etaDoc is one task as `enqueue eta --json` and `status --tasks --json`
// print it.
type etaDoc struct {
	Queue    string    `json:"queue"`
	ID       string    `json:"id"`
	WaitsAs  string    `json:"waits_as"`
	State    string    `json:"state"`
	At       time.Time `json:"at"`
	Position int       `json:"position"`
	Now      time.Time `json:"now"`
}

func (e etaDoc) wait() time.Duration { return e.At.Sub(e.Now) }

// planDoc is `enqueue plan --json`.
type planDoc struct {
	Now    time.Time      `json:"now"`
	Queues []queuePlanDoc `json:"queues"`
	Quotas []struct {
		Name string   `json:"name"`
		Busy *float64 `json:"busy"`
	} `json:"quotas"`
}

type queuePlanDoc struct {
	Name    string    `json:"name"`
	Tasks   int       `json:"tasks"`
	Empty   time.Time `json:"empty_at"`
	Seconds float64   `json:"seconds"`
}

// queue returns the plan of queue q.
func (p planDoc) queue(t *testing.T, q string) queuePlanDoc {
	t.Helper()
	i := slices.IndexFunc(p.Queues, func(p queuePlanDoc) bool { return p.Name == q })
	if i < 0 {
		t.Fatalf("plan has no queue %s: %+v", q, p)
	}
	return p.Queues[i]
}

// etaTaskLines writes n http:request lines for queue, task ids
// <queue>-<i> and paths /<queue>/<i> on u, every fourth with max_retry 0
// (such a task waits in Redis as a copy of itself).
func etaTaskLines(t *testing.T, u *upstream, queue string, n int) string {
	return writeLines(t, n, func(i int) string {
		options := fmt.Sprintf(`{"task_id": "%s-%d"}`, queue, i)
		if i%4 == 0 {
			options = fmt.Sprintf(`{"task_id": "%s-%d", "max_retry": 0}`, queue, i)
		}
		return fmt.Sprintf(`{"type": "http:request", "queue": %q, "payload": {"url": "%s/%s/%d"}, "options": %s}`, queue, u.URL, queue, i, options)
	})
}

// runJSON runs bin/enqueue with args on the fleet's config and decodes its
// stdout into v; it must exit 0.
func (r *fleetRun) runJSON(t *testing.T, v any, args ...string) {
	t.Helper()
	run := runEnqueue(t, redistest.Addr(t), nil, append([]string{"--config", r.config}, args...)...)
	if run.code != 0 {
		t.Fatalf("enqueue %q: exit %d: %s", args, run.code, run.stderr)
	}
	if err := json.Unmarshal([]byte(run.stdout), v); err != nil {
		t.Fatalf("enqueue %q: %v in %q", args, err, run.stdout)
	}
}

// TestETAAccuracy (issue 22 items 3 and 4): 3 workers drain a queue at
// 20/s (leaky bucket, burst 1); 400 http:request tasks from
// `enqueue --file`, every fourth with no retry left. `enqueue plan` run
// just before they are enqueued predicts the queue empty within 5% of the
// time it took (counted from when the paused queue is let go). While the
// queue is paused with all of them pending, `status --tasks` predicts each
// one's start from its position: 95% of those predicted 5 s or more away
// start within 5% of their predicted wait after the queue is let go (the
// workers take them in about that order; a reordering of a few places is
// 50 ms each, and a task now and then starts up to a second late: see
// docs/enqueue.md). 5 s into the run, 95% of the tasks booked then (those listed
// waiting in Redis for a turn, or holding for it in a worker) start within
// 100 ms of that turn; `enqueue eta` of one of them says the same turn
// (a task that waits as a copy: TestETAOfACopy). An unknown id exits 2
// naming it and its queue.
func TestETAAccuracy(t *testing.T) {
	t.Parallel()
	const tasks = 400
	queue := redistest.Queue(t, "eta")
	r := startFleet(t, backends[0], 3, fmt.Sprintf(`
worker: {concurrency: 10}
queues:
  %s: {drain: {algorithm: leaky_bucket, limit: 20, period: 1s, burst: 1}}
`, queue))
	lines := etaTaskLines(t, r.u, queue, tasks)

	var plan planDoc
	r.runJSON(t, &plan, "plan", "--file", lines, "--json")
	r.pause(t, queue)
	if run := runEnqueue(t, redistest.Addr(t), nil, "--config", r.config, "--file", lines); run.code != 0 {
		t.Fatalf("enqueue --file: exit %d: %s", run.code, run.stderr)
	}
	var pending struct{ Tasks []etaDoc }
	r.runJSON(t, &pending, "status", "--queue", queue, "--tasks", "--top", fmt.Sprint(tasks), "--json")
	start := r.letGo(t, queue)

	time.Sleep(5 * time.Second) // mid-run: about 100 tasks have run
	var midRun struct{ Tasks []etaDoc }
	r.runJSON(t, &midRun, "status", "--queue", queue, "--tasks", "--top", fmt.Sprint(tasks), "--json")
	var booked []etaDoc
	for _, e := range midRun.Tasks {
		if e.State == "booked" || e.State == "running" && !e.At.IsZero() {
			booked = append(booked, e)
		}
	}
	if len(booked) < 100 {
		t.Fatalf("%d tasks booked 5 s into the run, want at least 100: %+v", len(booked), midRun.Tasks[:min(5, len(midRun.Tasks))])
	}
	one := booked[len(booked)/2]
	var eta etaDoc
	r.runJSON(t, &eta, "eta", one.ID, "--json")
	if !eta.At.Equal(one.At) || eta.State != "booked" && eta.State != "running" {
		t.Errorf("enqueue eta %s: %+v, want the turn status --tasks gave, %v", one.ID, eta, one.At)
	}
	unknown := runEnqueue(t, redistest.Addr(t), nil, "--config", r.config, "eta", queue+"-nope", "--queue", queue)
	if unknown.code != 2 || !strings.Contains(unknown.stderr, queue+"-nope") || !strings.Contains(unknown.stderr, queue) {
		t.Errorf("enqueue eta of an unknown id: exit %d, %q; want 2 naming the id and the queue", unknown.code, unknown.stderr)
	}

	r.finish(t, tasks, 40*time.Second, queue)
	startOf := func(id string) time.Time {
		path := "/" + queue + "/" + strings.TrimPrefix(id, queue+"-")
		return r.u.Matching(func(p string) bool { return p == path })[0]
	}

	within := 0
	var worst time.Duration
	for _, e := range booked {
		off := startOf(e.ID).Sub(e.At)
		worst = max(worst, off.Abs())
		if off.Abs() <= 100*time.Millisecond {
			within++
		}
	}
	t.Logf("booked mid-run: %d of %d started within 100 ms of their turn (worst %v)", within, len(booked), worst.Round(time.Millisecond))
	if float64(within) < 0.95*float64(len(booked)) {
		t.Errorf("%d of %d booked tasks started within 100 ms of their turn, want 95%%", within, len(booked))
	}

	checked, close, worstShare := 0, 0, 0.0
	for _, e := range pending.Tasks {
		if e.State != "pending" || e.wait() < 5*time.Second {
			continue
		}
		checked++
		got := startOf(e.ID).Sub(start)
		share := math.Abs(got.Seconds()-e.wait().Seconds()) / e.wait().Seconds()
		worstShare = max(worstShare, share)
		if share <= 0.05 {
			close++
		} else {
			t.Logf("task %s at position %d: predicted to start %v after the queue was let go, started after %v (%.1f%% off)",
				e.ID, e.Position, e.wait().Round(time.Millisecond), got.Round(time.Millisecond), 100*share)
		}
	}
	t.Logf("pending: %d of %d tasks predicted 5 s or more away started within 5%% of it, the worst %.2f%% off", close, checked, 100*worstShare)
	if checked < 250 {
		t.Errorf("%d pending tasks predicted 5 s or more away, want about 300 (positions 101 to 400)", checked)
	}
	if float64(close) < 0.95*float64(checked) {
		t.Errorf("%d of %d pending tasks started within 5%% of their predicted wait, want 95%%", close, checked)
	}

	arrivals := r.u.All()
	took := arrivals[len(arrivals)-1].Sub(start).Seconds()
	predicted := plan.queue(t, queue).Seconds
	t.Logf("plan: empty after %.3f s predicted, %.3f s measured", predicted, took)
	if math.Abs(took-predicted) > 0.05*took {
		t.Errorf("plan predicted the queue empty after %.3f s, it took %.3f s: want within 5%%", predicted, took)
	}
}

// TestPlanSharedQuota (issue 22 item 4): three queues at drains of 5, 10
// and 20/s share a quota of 20/s (token bucket, burst 5) that binds: 60,
// 120 and 240 tasks (every fourth with no retry), planned by `enqueue plan
// --file` just before they are enqueued. Each queue ends within 5% of when
// the plan said, counted from when the paused queues are let go. The plan
// takes the queues in turn by priority; the fleet's first take is in
// asynq's random order, and booked as taken it held the shared quota's
// first seconds out of that turn: the 5/s queue ended up to 10.3% late,
// the middle one -5% to +9% (2026-12-03 to 12-06). Now a fresh task whose
// turn on a shared quota is further than 250 ms is handed to the parker
// unbooked (jobs.toParker, TestFirstTakeLeavesASharedQuotaToTheParker),
// which books the queues in turn: 9 runs on 2026-12-07 (3 beside two
// CPU-bound processes, 1 in the whole package), each queue 0 to 2.2% later
// than the plan. The plan has
// the quota busy all along. A plan 4 s into the run, from the backlog in
// Redis (tasks booked, woken for their turn, pending), predicts what is
// left of each queue within 5%.
func TestPlanSharedQuota(t *testing.T) {
	t.Parallel()
	rates := []int{5, 10, 20}
	r, queues := startSharedQuota(t, backends[0], rates, "limit: 20, period: 1s, burst: 5")
	var all []string
	for i, q := range queues {
		lines := readFileLines(t, etaTaskLines(t, r.u, q, 12*rates[i]))
		all = append(all, lines...)
	}
	path := writeLines(t, len(all), func(i int) string { return all[i-1] })
	var plan planDoc
	r.runJSON(t, &plan, "plan", "--file", path, "--json")
	r.pause(t, queues...)
	if run := runEnqueue(t, redistest.Addr(t), nil, "--config", r.config, "--file", path); run.code != 0 {
		t.Fatalf("enqueue --file: exit %d: %s", run.code, run.stderr)
	}
	start := r.letGo(t, queues...)
	time.Sleep(4 * time.Second)
	var midRun planDoc
	r.runJSON(t, &midRun, "plan", "--json")
	r.finish(t, len(all), 60*time.Second, queues...)
	for _, q := range queues {
		const bound = 0.05
		own := r.u.Under(q)
		last := own[len(own)-1]
		widest := 0
		for j := 1; j < len(own); j++ {
			if own[j].Sub(own[j-1]) > own[widest+1].Sub(own[widest]) {
				widest = j - 1
			}
		}
		t.Logf("%s: its widest gap %v, after its task %d, %v from the start", q, own[widest+1].Sub(own[widest]).Round(time.Millisecond), widest+1, own[widest].Sub(start).Round(time.Millisecond))
		took, predicted := last.Sub(start).Seconds(), plan.queue(t, q).Seconds
		left, predictedLeft := last.Sub(midRun.Now).Seconds(), midRun.queue(t, q).Empty.Sub(midRun.Now).Seconds()
		t.Logf("%s (%d tasks): empty after %.3f s predicted, %.3f s measured; 4 s in, %.3f s more predicted, %.3f s measured",
			q, len(own), predicted, took, predictedLeft, left)
		if math.Abs(took-predicted) > bound*took {
			t.Errorf("queue %s: plan predicted it empty after %.3f s, it took %.3f s: want within %.0f%%", q, predicted, took, 100*bound)
		}
		if math.Abs(left-predictedLeft) > 0.05*left {
			t.Errorf("queue %s: plan 4 s into the run predicted it empty %.3f s later, it took %.3f s: want within 5%%", q, predictedLeft, left)
		}
	}
	if len(plan.Quotas) != 1 || plan.Quotas[0].Busy == nil || *plan.Quotas[0].Busy < 0.95 {
		t.Errorf("plan's quotas %+v, want the one quota busy all along", plan.Quotas)
	}
}

// TestETAOfACopy (issue 22 item 3): a task with no retry left that must
// wait longer than its worker's waiting room allows waits in Redis as a
// copy under another id; `enqueue eta` finds it by its own id, with the
// copy's turn. One worker (concurrency 10, waiting 2) takes 12 such tasks
// at once behind a drain of 2/s: one runs, one waits in the worker, the
// others go back as copies (none is left pending for the parker).
func TestETAOfACopy(t *testing.T) {
	t.Parallel()
	queue := redistest.Queue(t, "copy")
	r := startFleet(t, backends[0], 1, fmt.Sprintf(`
worker: {concurrency: 10, waiting: 2}
queues:
  %s: {drain: {algorithm: leaky_bucket, limit: 2, period: 1s, burst: 1}}
`, queue))
	lines := writeLines(t, 12, func(i int) string {
		return fmt.Sprintf(`{"type": "http:request", "queue": %q, "payload": {"url": "%s/%s/%d"}, "options": {"task_id": "%s-%d", "max_retry": 0}}`, queue, r.u.URL, queue, i, queue, i)
	})
	r.pause(t, queue)
	if run := runEnqueue(t, redistest.Addr(t), nil, "--config", r.config, "--file", lines); run.code != 0 {
		t.Fatalf("enqueue --file: exit %d: %s", run.code, run.stderr)
	}
	r.letGo(t, queue)
	var copied etaDoc
	testkit.WaitFor(t, 5*time.Second, "a task waiting as a copy", func() bool {
		var status struct{ Tasks []etaDoc }
		r.runJSON(t, &status, "status", "--queue", queue, "--tasks", "--json")
		i := lastIndexFunc(status.Tasks, func(e etaDoc) bool { return e.WaitsAs != "" && !e.At.IsZero() })
		if i >= 0 {
			copied = status.Tasks[i]
		}
		return i >= 0
	})
	var eta etaDoc
	r.runJSON(t, &eta, "eta", copied.ID, "--queue", queue, "--json")
	if eta.WaitsAs != copied.WaitsAs || !eta.At.Equal(copied.At) {
		t.Errorf("enqueue eta %s: %+v, want it found as its copy %s, turn %v", copied.ID, eta, copied.WaitsAs, copied.At)
	}
	r.finish(t, 12, 20*time.Second, queue)
}

// readFileLines returns the lines of the file at path.
func readFileLines(t *testing.T, path string) []string {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return strings.Split(strings.TrimSpace(string(data)), "\n")
}

// TestETAAndPlanBadInput: enqueue eta, status --tasks and plan refuse
// bad arguments and files with exit 2 and a message naming the problem,
// and eta names an id no queue holds, with the queues it searched.
func TestETAAndPlanBadInput(t *testing.T) {
	t.Parallel()
	queue := redistest.Queue(t, "bad")
	config := enqueueConfig(t, queue)
	badLine := writeLines(t, 2, func(i int) string {
		if i == 2 {
			return `{"type": "http:request", "payload": {"url": 5}}`
		}
		return `{"type": "http:request", "payload": {"url": "https://example.com/"}}`
	})
	for _, c := range []struct {
		desc string
		args []string
		want []string
	}{
		{"no id", []string{"eta"}, []string{"one TASK_ID"}},
		{"two ids", []string{"eta", "a", "b"}, []string{"one TASK_ID"}},
		{"a long id", []string{"eta", strings.Repeat("x", 2000)}, []string{"TASK_ID is 1 to"}},
		{"a bad queue", []string{"eta", "a", "--queue", "a{b}"}, []string{"--queue"}},
		{"an unknown id in one queue", []string{"eta", "nope-1", "--queue", queue}, []string{`"nope-1"`, queue}},
		{"an unknown id anywhere", []string{"eta", "nope-2"}, []string{`"nope-2"`, queue}},
		{"tasks without a queue", []string{"status", "--tasks"}, []string{"--tasks and --queue"}},
		{"a queue without tasks", []string{"status", "--queue", queue}, []string{"--tasks and --queue"}},
		{"tasks and keys", []string{"status", "--queue", queue, "--tasks", "--keys", "quota:x"}, []string{"--keys"}},
		{"top 0", []string{"status", "--queue", queue, "--tasks", "--top", "0"}, []string{"--top must be from 1"}},
		{"plan with an argument", []string{"plan", "tasks.jsonl"}, []string{"--file"}},
		{"plan of a missing file", []string{"plan", "--file", "/nonexistent/tasks.jsonl"}, []string{"/nonexistent/tasks.jsonl"}},
		{"plan of a bad line", []string{"plan", "--file", badLine}, []string{"line 2", "url"}},
	} {
		run := runEnqueue(t, redistest.Addr(t), nil, append([]string{"--config", config}, c.args...)...)
		if run.code != 2 {
			t.Errorf("%s: enqueue %q exited %d, want 2; stderr %q", c.desc, c.args, run.code, run.stderr)
			continue
		}
		for _, want := range c.want {
			if !strings.Contains(run.stderr, want) {
				t.Errorf("%s: enqueue %q said %q, want it to name %q", c.desc, c.args, run.stderr, want)
			}
		}
	}
}

// TestPlanWithLimitSetLive: enqueue plan and eta go by the limits in force:
// a drain of 20/s set live to 40/s (enqueue limits set) plans 400 tasks
// empty after 9.975 s instead of 19.95 s, and predicts the last pending
// one 9.975 s away.
func TestPlanWithLimitSetLive(t *testing.T) {
	t.Parallel()
	queue := redistest.Queue(t, "live")
	config := writeConfig(t, fmt.Sprintf("redis: {addr: 127.0.0.1:1}\nqueues:\n  %s: {drain: {algorithm: leaky_bucket, limit: 20, period: 1s, burst: 1}}\n", queue))
	lines := writeLines(t, 400, func(i int) string {
		return fmt.Sprintf(`{"type": "demo:noop", "queue": %q, "options": {"task_id": "%s-%d"}}`, queue, queue, i)
	})
	r := &fleetRun{config: config}
	var before, after planDoc
	r.runJSON(t, &before, "plan", "--file", lines, "--json")
	if run := runEnqueue(t, redistest.Addr(t), nil, "--config", config, "limits", "set", "drain:"+queue, "--limit", "40", "--reason", "plan test"); run.code != 0 {
		t.Fatalf("limits set: exit %d: %s", run.code, run.stderr)
	}
	t.Cleanup(func() {
		runEnqueue(t, redistest.Addr(t), nil, "--config", config, "limits", "reset", "drain:"+queue, "--reason", "plan test done")
	})
	r.runJSON(t, &after, "plan", "--file", lines, "--json")
	if got := before.queue(t, queue).Seconds; got != 19.95 {
		t.Errorf("plan at 20/s: empty after %v s, want 19.95", got)
	}
	if got := after.queue(t, queue).Seconds; got != 9.975 {
		t.Errorf("plan with the drain set live to 40/s: empty after %v s, want 9.975", got)
	}
	if run := runEnqueue(t, redistest.Addr(t), nil, "--config", config, "--file", lines); run.code != 0 {
		t.Fatalf("enqueue --file: exit %d: %s", run.code, run.stderr)
	}
	var pending struct{ Tasks []etaDoc }
	r.runJSON(t, &pending, "status", "--queue", queue, "--tasks", "--top", "400", "--json")
	last := pending.Tasks[len(pending.Tasks)-1]
	if last.Position != 400 || last.wait() != 9975*time.Millisecond {
		t.Errorf("the last pending task: %+v, predicted %v away; want position 400, 9.975 s", last, last.wait())
	}
}

// lastIndexFunc is slices.IndexFunc from the end.
func lastIndexFunc[T any](s []T, f func(T) bool) int {
	for i := len(s) - 1; i >= 0; i-- {
		if f(s[i]) {
			return i
		}
	}
	return -1
}
