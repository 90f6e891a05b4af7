package producer

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
)

// Tally is what became of the tasks of a load, told to Add in their
// order: counts, and for each kind of outcome the ranges of lines (or
// copies) it holds. A load stops at its first failure, so outcomes change
// only near it, and the ranges stay few however long the input. Use
// NewTally.
type Tally struct {
	n        map[Outcome]int
	tasks    int
	firstErr error
	// first is the line of the first task not surely in Redis; 0 while
	// there is none. A resumed run starts there.
	first int
	kinds [3]ranges // in Redis, uncertain, not enqueued
	// again holds the tasks from first on that are or may be in Redis and
	// have no task id: resuming would enqueue them a second time.
	again  ranges
	withID int // those from first on that are or may be in Redis and have a task id
}

// Kinds of outcome, as the report groups them.
const (
	kindInRedis = iota
	kindUncertain
	kindNotEnqueued
)

// NewTally returns an empty Tally.
func NewTally() *Tally { return &Tally{n: map[Outcome]int{}} }

// Add counts t's result r; t is the tally's next task.
func (y *Tally) Add(t Task, r Result) {
	i := y.tasks
	y.tasks++
	y.n[r.Outcome]++
	if y.firstErr == nil {
		y.firstErr = r.Err
	}
	kind := kindNotEnqueued
	switch {
	case r.Outcome.InRedis():
		kind = kindInRedis
	case r.Outcome == Uncertain:
		kind = kindUncertain
	}
	y.kinds[kind].add(i, t.Line)
	if y.first == 0 && kind != kindInRedis {
		y.first = t.Line
	}
	if y.first != 0 && kind != kindNotEnqueued {
		if t.TaskID == "" {
			y.again.add(i, t.Line)
		} else {
			y.withID++
		}
	}
}

// Tasks is how many tasks were added.
func (y *Tally) Tasks() int { return y.tasks }

// Count is how many tasks had outcome o.
func (y *Tally) Count(o Outcome) int { return y.n[o] }

// Landed is how many tasks are surely in Redis (or one like each is).
func (y *Tally) Landed() int { return y.n[Enqueued] + y.n[Existed] + y.n[Duplicate] }

// Err is the first task's error, or "interrupted" if none failed: what
// stopped a load that did not land every task.
func (y *Tally) Err() error {
	if y.firstErr != nil {
		return y.firstErr
	}
	return errors.New("interrupted")
}

// stopped says why a load stopped short: Redis (named by redisName)
// failed, or Ctrl-C.
func (y *Tally) stopped(redisName string) string {
	if y.firstErr != nil {
		return redisName + " failed"
	}
	return "stopped"
}

// AlreadyThere describes the tasks that were in Redis before, for a
// summary line: ", 2 already enqueued (their task_id was taken)", or "".
func (y *Tally) AlreadyThere() string {
	var s string
	if y.n[Existed] > 0 {
		s += fmt.Sprintf(", %d already enqueued (their task_id was taken)", y.n[Existed])
	}
	if y.n[Duplicate] > 0 {
		s += fmt.Sprintf(", %d not enqueued as duplicates (unique)", y.n[Duplicate])
	}
	return s
}

// CopiesFailure reports a load of copies of one task (enqueue --count)
// that Redis, named by redisName, or Ctrl-C cut short: which copies are in
// Redis, which may be, which are not, and how to enqueue the rest.
func (y *Tally) CopiesFailure(redisName string) error {
	var b strings.Builder
	failed := y.tasks - y.Landed()
	if y.tasks == 1 {
		fmt.Fprintf(&b, "%s: %v", y.stopped(redisName), y.Err())
		if y.n[Uncertain] > 0 {
			b.WriteString("\nthe task was sent, but the connection broke before Redis answered: it may be in Redis or not")
		} else {
			b.WriteString("\nthe task was not enqueued")
		}
		return errors.New(b.String())
	}
	fmt.Fprintf(&b, "%s after %d of %d copies: %v\n", y.stopped(redisName), y.n[Enqueued], y.tasks, y.Err())
	y.writeOutcomes(&b, "copies")
	if y.n[Uncertain] == 0 {
		fmt.Fprintf(&b, "to enqueue the rest, run the same command with --count %d", failed)
	} else {
		fmt.Fprintf(&b, "to enqueue the rest, run the same command with --count %d, or %d if the uncertain copies are not in Redis", y.n[NotTried]+y.n[Refused], failed)
	}
	return errors.New(b.String())
}

// FileFailure reports a load of the file name that Redis, named by
// redisName (or readErr, a file that changed between its two readings),
// cut short: which lines are in Redis, which may be, which are not, and
// how to resume.
func (y *Tally) FileFailure(name, redisName string, readErr error) error {
	var b strings.Builder
	if readErr != nil {
		fmt.Fprintf(&b, "stopped part way: %v\n", readErr)
	} else {
		fmt.Fprintf(&b, "%s part way: %v\n", y.stopped(redisName), y.Err())
	}
	fmt.Fprintf(&b, "%s: %d of %d tasks are in Redis%s\n", name, y.Landed(), y.tasks, y.AlreadyThere())
	y.writeOutcomes(&b, "lines")
	if y.first == 0 {
		// Every task read is in Redis: the file changed after them.
		fmt.Fprintf(&b, "the lines after these were not read; check the file before you resume")
		return errors.New(b.String())
	}
	fmt.Fprintf(&b, "to resume, run the same command with --skip %d (the lines before line %d, the first that is not surely in Redis)", y.first-1, y.first)
	// A resumed run sends every line from first on again; those that are or
	// may be in Redis count as already enqueued only if they have a task id.
	switch {
	case y.again.count > 0:
		fmt.Fprintf(&b, "\nwarning: these lines from line %d on are or may be in Redis and have no task_id, so resuming would enqueue them again: %s (%d)",
			y.first, &y.again, y.again.count)
	case y.withID > 0:
		fmt.Fprintf(&b, "; the %s after it that are or may be in Redis have a task_id, so they will count as already enqueued, not twice", plural(y.withID, "line"))
	}
	return errors.New(b.String())
}

// writeOutcomes writes the positions (lines or copies) of each outcome.
func (y *Tally) writeOutcomes(b *strings.Builder, what string) {
	rows := []struct {
		label string
		kind  int
		note  string
	}{
		{"in Redis", kindInRedis, ""},
		{"uncertain", kindUncertain, ": sent, but the connection broke before Redis answered; each may be in Redis or not"},
		{"not enqueued", kindNotEnqueued, ""},
	}
	for _, row := range rows {
		if rs := &y.kinds[row.kind]; rs.count > 0 {
			fmt.Fprintf(b, "  %-13s %s %s (%d)%s\n", row.label+":", what, rs, rs.count, row.note)
		}
	}
}

// ranges are runs of tasks that follow each other in a load, written as
// their lines: "1-500, 502, 504-600". Tasks next to each other in the load
// are one run whatever lies between their lines (blank lines).
type ranges struct {
	runs  [][2]int // first and last line
	count int
	last  int // the position in the load of the last task added
}

func (rs *ranges) add(position, line int) {
	if len(rs.runs) > 0 && position == rs.last+1 {
		rs.runs[len(rs.runs)-1][1] = line
	} else {
		rs.runs = append(rs.runs, [2]int{line, line})
	}
	rs.last = position
	rs.count++
}

func (rs *ranges) String() string {
	var b strings.Builder
	for _, run := range rs.runs {
		if b.Len() > 0 {
			b.WriteString(", ")
		}
		b.WriteString(strconv.Itoa(run[0]))
		if run[1] != run[0] {
			fmt.Fprintf(&b, "-%d", run[1])
		}
	}
	return b.String()
}

// plural is n and word, with an s unless n is 1: "1 task", "2 tasks".
func plural(n int, word string) string {
	if n == 1 {
		return "1 " + word
	}
	return fmt.Sprintf("%d %ss", n, word)
}
