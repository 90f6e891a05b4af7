package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/sluicehq/sluice/config"
	"github.com/sluicehq/sluice/jobs"
	"github.com/sluicehq/sluice/producer"
)

// maxCount is the most copies one --count makes: a typo's extra digits
// would otherwise fill Redis.
const maxCount = 1_000_000

// enqueueFlags are the root command's flags.
type enqueueFlags struct {
	queue, file string
	count, skip int

	processIn, processAt, timeout, deadline, unique, taskID, retention, group string
	maxRetry                                                                  int
}

func newEnqueueCommand(a *app) *cobra.Command {
	var f enqueueFlags
	var types strings.Builder
	for _, t := range jobs.Types() {
		fmt.Fprintf(&types, "  %-13s %s\n", t.Name, t.Doc)
	}
	cmd := &cobra.Command{
		Use:   "enqueue [flags] TYPE [PAYLOAD_JSON] | --file FILE",
		Short: "Enqueue sluice tasks, or show the queues (enqueue status)",
		Long: `Enqueue one task (or --count copies) of TYPE with PAYLOAD_JSON and print its id,
or every task of a JSON Lines file (--file, "-" for stdin), one per line:

  {"type": "demo:sleep", "payload": {"ms": 100}, "queue": "reports", "options": {"max_retry": 3, "task_id": "r-1"}}

Only "type" is required. The options are the flags' names in snake_case
(process_in, process_at, max_retry, timeout, deadline, unique, task_id,
retention, group); flags given with --file apply to every line that does not
set the option itself. Everything is checked before anything is written.
A run that Redis cut short says which lines landed; rerun it with --skip N
(lines with task_id count as already enqueued, not twice).

Task types: the built-in ones,
` + types.String() + `and those named under tasks: in the config. A payload is checked against
its type: a built-in type's by its own rules (and tasks.TYPE.schema, if set),
another's by the JSON Schema file of tasks.TYPE.schema, or as any JSON value
when it has none; a violation is reported with its JSON path.

Exit codes: 0 done, 1 Redis failed (or Ctrl-C) part way, 2 bad input or
config (nothing enqueued).`,
		Example: `  enqueue demo:sleep '{"ms": 250}' --queue reports --max-retry 3
  enqueue http:request '{"url": "http://localhost:8000/"}' --process-in 5m --count 10
  enqueue --file tasks.jsonl --queue bulk
  enqueue status --watch`,
		Args: func(cmd *cobra.Command, args []string) error {
			if len(args) > 2 {
				return badInput(fmt.Errorf("want TYPE [PAYLOAD_JSON], got %d arguments (quote the payload)", len(args)))
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			values, err := f.check(cmd.Flags(), args)
			if err != nil {
				return badInput(err)
			}
			if f.file != "" {
				return a.enqueueFile(cmd, f, values)
			}
			return a.enqueueCopies(cmd, f, values, args)
		},
	}
	fl := cmd.Flags()
	fl.SortFlags = false
	fl.StringVar(&f.queue, "queue", "default", "the `queue` (case counts); a queue config.yaml does not name gets a warning")
	fl.IntVar(&f.count, "count", 1, "enqueue `N` copies of the task (at most 1,000,000)")
	fl.StringVar(&f.file, "file", "", "enqueue the tasks of a JSON Lines `FILE` (\"-\": stdin)")
	fl.IntVar(&f.skip, "skip", 0, "with --file: skip the first `N` lines (to resume a run Redis cut short)")
	fl.StringVar(&f.processIn, "process-in", "", "run the task after this `duration` (5m)")
	fl.StringVar(&f.processAt, "process-at", "", "run the task at this RFC 3339 `time` (2030-01-02T15:04:05Z)")
	fl.IntVar(&f.maxRetry, "max-retry", 25, "retry a failed task up to `N` times")
	fl.StringVar(&f.timeout, "timeout", "", "time limit of one run, in whole seconds (`duration`; default: asynq's 30m)")
	fl.StringVar(&f.deadline, "deadline", "", "give up on the task after this RFC 3339 `time`")
	fl.StringVar(&f.unique, "unique", "", "refuse a task like it (type, payload, queue) for this `duration`")
	fl.StringVar(&f.taskID, "task-id", "", "the task's `id`, at most "+fmt.Sprint(producer.MaxTaskID)+" bytes (default: a random UUID); an id already taken counts as already enqueued")
	fl.StringVar(&f.retention, "retention", "", "keep the task this `duration` after it is done")
	fl.StringVar(&f.group, "group", "", "aggregate the task into `group`")
	return cmd
}

// check checks the flags and arguments that do not depend on each task and
// returns the options the flags set.
func (f enqueueFlags) check(fs *pflag.FlagSet, args []string) (producer.Options, error) {
	var errs []error
	bad := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }
	set := func(name string, s *string) *string {
		if fs.Changed(name) {
			return s
		}
		return nil
	}
	var v producer.Options
	v.ProcessIn, v.ProcessAt = set("process-in", &f.processIn), set("process-at", &f.processAt)
	v.Timeout, v.Deadline, v.Unique = set("timeout", &f.timeout), set("deadline", &f.deadline), set("unique", &f.unique)
	v.TaskID, v.Retention, v.Group = set("task-id", &f.taskID), set("retention", &f.retention), set("group", &f.group)
	if fs.Changed("max-retry") {
		v.MaxRetry = &f.maxRetry
	}
	if _, problems := v.Check(flagName, time.Now()); len(problems) > 0 {
		errs = append(errs, problems...)
	}
	if err := producer.CheckQueue(f.queue); err != nil {
		bad("--queue: %v", err)
	}
	if f.file != "" {
		if len(args) > 0 {
			bad("--file: the tasks come from %s; TYPE and PAYLOAD_JSON cannot be given too", f.file)
		}
		if fs.Changed("count") {
			bad("--count cannot be used with --file: a line is one task")
		}
		if v.TaskID != nil {
			bad("--task-id cannot be used with --file: give each line its own task_id option")
		}
		if f.skip < 0 {
			bad("--skip must be >= 0, got %d", f.skip)
		}
		return v, joinProblems(errs)
	}
	switch {
	case len(args) == 0:
		bad("missing TYPE: give a task type (%s, or one named under tasks: in the config) and its payload, or --file (see --help)", knownTypes())
	case fs.Changed("skip"):
		bad("--skip goes with --file")
	}
	switch {
	case f.count < 1:
		bad("--count must be >= 1, got %d", f.count)
	case f.count > maxCount:
		bad("--count must be at most %s, got %d; for more, run it again or use --file", grouped(maxCount), f.count)
	case f.count > 1 && v.TaskID != nil:
		bad("--task-id cannot be used with --count %d: the copies would all need the same id", f.count)
	case f.count > 1 && v.Unique != nil:
		bad("--unique cannot be used with --count %d: every copy after the first would be refused as a duplicate", f.count)
	}
	return v, joinProblems(errs)
}

// joinProblems is nil for no errors, the error for one, and a list for more.
func joinProblems(errs []error) error {
	switch len(errs) {
	case 0:
		return nil
	case 1:
		return errs[0]
	}
	var b strings.Builder
	fmt.Fprintf(&b, "%d problems; nothing was enqueued:", len(errs))
	for _, err := range errs {
		b.WriteString("\n  ")
		b.WriteString(err.Error())
	}
	return errors.New(b.String())
}

func knownTypes() string {
	var names []string
	for _, t := range jobs.Types() {
		names = append(names, t.Name)
	}
	return strings.Join(names, ", ")
}

// flagName spells an option key as its flag: max_retry is --max-retry.
func flagName(key string) string { return "--" + strings.ReplaceAll(key, "_", "-") }

// enqueueCopies enqueues --count copies of the task in args and prints the
// id of each copy that is in Redis.
func (a *app) enqueueCopies(cmd *cobra.Command, f enqueueFlags, values producer.Options, args []string) error {
	o, _ := values.Check(flagName, time.Now()) // checked by enqueueFlags.check
	var payload []byte
	if len(args) == 2 {
		payload = []byte(args[1])
	}
	file, err := a.loadConfig() // first: it names the task types and their schemas
	if err != nil {
		return err
	}
	t, err := producer.NewTask(args[0], payload, f.queue, o, file)
	if err != nil {
		return badInput(err)
	}
	warnUnconfigured(cmd.ErrOrStderr(), file, map[string]int{f.queue: f.count}, 0)
	copies := 0
	next := func() (producer.Task, bool, error) {
		if copies == f.count {
			return producer.Task{}, false, nil
		}
		copies++
		c := t
		c.Line = copies
		return c, true, nil
	}
	out := cmd.OutOrStdout()
	y, _, err := connectAndLoad(cmd, file, f.count, next, f.count > 1, func(r producer.Result) {
		if r.ID != "" {
			fmt.Fprintln(out, r.ID)
		}
	})
	if err != nil {
		return err
	}
	switch {
	case y.Count(producer.Existed) > 0:
		fmt.Fprintf(cmd.ErrOrStderr(), "enqueue: already enqueued: queue %q has a task with id %q\n", t.Queue, t.TaskID)
	case y.Count(producer.Duplicate) > 0:
		fmt.Fprintf(cmd.ErrOrStderr(), "enqueue: not enqueued: queue %q has a task of the same type and payload, unique for --unique %s\n", t.Queue, f.unique)
	}
	if y.Landed() < y.Tasks() {
		return redisFailed(y.CopiesFailure(redisAt(file.Redis)))
	}
	return nil
}

// enqueueFile enqueues every task of --file and prints a summary. The file
// is read twice, so that what a run holds does not grow with it: first
// every line is checked, then the lines are loaded a batch at a time.
func (a *app) enqueueFile(cmd *cobra.Command, f enqueueFlags, values producer.Options) error {
	start := time.Now()
	var in *os.File
	name := "stdin"
	var err error
	if f.file == "-" {
		in, err = producer.Spool(cmd.InOrStdin())
	} else {
		in, err = producer.OpenFile(f.file)
		name = f.file
	}
	if err != nil {
		return badInput(err)
	}
	defer in.Close()
	// The config is read first: the check counts tasks by queue, known or not.
	file, err := a.loadConfig()
	if err != nil {
		return err
	}
	known := func(q string) bool { _, ok := file.Jobs.Queues[q]; return ok }
	now := time.Now()
	d := producer.Defaults{Queue: f.queue, Options: values, Payloads: file}
	c, err := producer.CheckTasks(in, name, f.skip, d, now, known)
	if err != nil {
		return badInput(err)
	}
	warnUnconfigured(cmd.ErrOrStderr(), file, c.Queues, c.More)
	if c.Tasks == 0 {
		fmt.Fprintf(cmd.OutOrStdout(), "%s: no tasks to enqueue\n", name)
		return nil
	}
	if _, err := in.Seek(0, io.SeekStart); err != nil {
		return badInput(fmt.Errorf("reading %s again: %w; nothing was enqueued", name, err))
	}
	checkedIn := time.Since(start)
	y, elapsed, err := connectAndLoad(cmd, file, c.Tasks, producer.FileTasks(in, name, f.skip, d, now), true, func(producer.Result) {})
	switch {
	case err != nil && y == nil:
		return err
	case err == nil && y.Landed() == c.Tasks:
		fmt.Fprintf(cmd.OutOrStdout(), "%s: %d tasks in %.2fs (%s tasks/s; read and checked in %.2fs): %d enqueued%s\n",
			name, y.Tasks(), elapsed.Seconds(), grouped(float64(y.Tasks())/elapsed.Seconds()), checkedIn.Seconds(), y.Count(producer.Enqueued), y.AlreadyThere())
		return nil
	}
	return redisFailed(y.FileFailure(name, redisAt(file.Redis), err))
}

// connectAndLoad connects to Redis and enqueues the total tasks next
// yields, with progress on stderr if asked, and returns the tally of their
// results and how long enqueueing took; each gets every result, in order.
// It fails with a nil tally when Redis cannot be reached at all: nothing
// was enqueued. An error of next comes with the tally of what was loaded.
func connectAndLoad(cmd *cobra.Command, file config.File, total int, next func() (producer.Task, bool, error), progress bool, each func(producer.Result)) (*producer.Tally, time.Duration, error) {
	r := file.Redis
	rdb := newEnqueueClient(r, producer.LoadPool)
	defer rdb.Close()
	loader := producer.NewLoader(rdb)
	loader.SpreadOver(file.Shards) // a sharded queue's tasks over its shards
	ctx, cancel := context.WithTimeout(cmd.Context(), 10*time.Second)
	err := r.Ping(ctx, rdb)
	cancel()
	if err != nil {
		return nil, 0, redisFailed(fmt.Errorf("%w; nothing was enqueued", err))
	}
	var done atomic.Int64
	stop := func() {}
	if progress {
		stop = showProgress(cmd.ErrOrStderr(), total, &done)
	}
	start := time.Now()
	y := producer.NewTally()
	err = loader.Load(cmd.Context(), next, &done, func(t producer.Task, res producer.Result) {
		y.Add(t, res)
		each(res)
	})
	elapsed := time.Since(start)
	stop()
	return y, elapsed, err
}

// warnUnconfigured warns about queues (with their task counts) that
// config.yaml does not name: workers serve only the queues it names. more
// counts tasks in further queues, not named.
func warnUnconfigured(w io.Writer, f config.File, queues map[string]int, more int) {
	for _, q := range slices.Sorted(maps.Keys(queues)) {
		if _, ok := f.Jobs.Queues[q]; !ok {
			fmt.Fprintf(w, "enqueue: warning: queue %q (%s) is not under queues in the config; no worker serves it until it is\n", q, plural(queues[q], "task"))
		}
	}
	if more > 0 {
		fmt.Fprintf(w, "enqueue: warning: %s in further queues that the config does not name\n", plural(more, "task"))
	}
}

// plural is n and word, with an s unless n is 1: "1 task", "2 tasks".
func plural(n int, word string) string {
	if n == 1 {
		return "1 " + word
	}
	return fmt.Sprintf("%d %ss", n, word)
}
