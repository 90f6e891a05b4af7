package producer

import (
	"bufio"
	"bytes"
	"cmp"
	"errors"
	"fmt"
	"hash/maphash"
	"io"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
)

const (
	// maxLine is the longest line a file may hold.
	maxLine = 16 << 20
	// maxProblems is how many bad lines are shown; the rest are counted.
	maxProblems = 20
	// maxSpool is the most of stdin that Spool takes: stdin is read twice
	// (checked, then loaded), so it is first copied to a temp file.
	maxSpool = 1 << 30
	// maxQueueNames is how many queues the config does not name are
	// warned about by name; the rest are counted.
	maxQueueNames = 20
)

// bom is the UTF-8 byte-order mark some editors put at the start of a file.
var bom = []byte("\xEF\xBB\xBF")

// OpenFile opens the JSON Lines file at path for CheckTasks and FileTasks;
// its errors are worded for enqueue's --file.
func OpenFile(path string) (*os.File, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("--file: %w", err)
	}
	if st, err := f.Stat(); err == nil && st.IsDir() {
		f.Close()
		return nil, fmt.Errorf("--file: %s is a directory", path)
	}
	return f, nil
}

// Spool copies r (stdin, for enqueue --file -), at most 1 GiB of it, to a
// temp file that is already removed from its directory, and returns it at
// its start: stdin cannot be read twice, CheckTasks then FileTasks.
func Spool(r io.Reader) (*os.File, error) {
	f, err := os.CreateTemp("", "enqueue-stdin-")
	if err != nil {
		return nil, fmt.Errorf("--file -: stdin is read twice, so it is copied to a temp file first: %w", err)
	}
	os.Remove(f.Name()) // gone when closed, whatever happens
	n, err := io.Copy(f, io.LimitReader(r, maxSpool+1))
	switch {
	case err != nil:
		f.Close()
		return nil, fmt.Errorf("--file -: copying stdin to a temp file: %w", err)
	case n > maxSpool:
		f.Close()
		return nil, fmt.Errorf("--file -: stdin holds more than %d GiB; write it to a file and give its path to --file", maxSpool>>30)
	}
	if _, err := f.Seek(0, io.SeekStart); err != nil {
		f.Close()
		return nil, fmt.Errorf("--file -: %w", err)
	}
	return f, nil
}

// lineReader yields the lines of JSON Lines input that hold a task, with
// their numbers in the input: blank lines and the first skip lines are
// passed over, and a byte-order mark before the first line is dropped.
type lineReader struct {
	sc   *bufio.Scanner
	name string
	skip int
	line int    // the number of the last line read
	data []byte // its content, valid until the next call of next
}

func newLineReader(r io.Reader, name string, skip int) *lineReader {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64<<10), maxLine)
	return &lineReader{sc: sc, name: name, skip: skip}
}

// next moves to the next line that holds a task; false at the end or on
// an error (see err).
func (lr *lineReader) next() bool {
	for lr.sc.Scan() {
		lr.line++
		lr.data = lr.sc.Bytes()
		if lr.line == 1 {
			lr.data = bytes.TrimPrefix(lr.data, bom)
		}
		if lr.line > lr.skip && len(bytes.TrimSpace(lr.data)) > 0 {
			return true
		}
	}
	return false
}

// err is why next returned false; nil at the end of the input.
func (lr *lineReader) err() error {
	switch err := lr.sc.Err(); {
	case errors.Is(err, bufio.ErrTooLong):
		return fmt.Errorf("%s: line %d is longer than %d MiB; nothing was enqueued", lr.name, lr.line+1, maxLine>>20)
	case err != nil:
		return fmt.Errorf("reading %s: %w; nothing was enqueued", lr.name, err)
	case lr.skip > lr.line:
		return fmt.Errorf("--skip %d: %s has only %d lines", lr.skip, lr.name, lr.line)
	}
	return nil
}

// Checked is what CheckTasks found: how many tasks a file holds and in
// which queues.
type Checked struct {
	Tasks    int
	LastLine int            // the line of the last task
	Queues   map[string]int // tasks per queue: every queue known names, and up to 20 others
	More     int            // tasks in queues past those
}

// CheckTasks reads and checks every task of r, JSON Lines named name in
// messages, after its first skip lines, each by DecodeLine with d at now,
// holding none of them: memory does not grow with the input, except by 8
// bytes for each line with a task_id (a task id given twice in one queue
// is a bad line too). If any line is bad, the error names the first 20
// bad lines and counts the rest. known tells the queues the config names.
// r must be an io.Seeker when lines give task ids: duplicates are found by
// a second reading.
func CheckTasks(r io.Reader, name string, skip int, d Defaults, now time.Time, known func(queue string) bool) (Checked, error) {
	return ReadTasks(r, name, skip, d, now, known, nil)
}

// ReadTasks is CheckTasks that also gives each good task, with its Line,
// to each (if not nil) as it is read: one reading for a caller that holds
// the tasks anyway (enqueue plan). If any line is bad, the tasks given
// are not all of them.
func ReadTasks(r io.Reader, name string, skip int, d Defaults, now time.Time, known func(queue string) bool, each func(Task)) (Checked, error) {
	lr := newLineReader(r, name, skip)
	c := Checked{Queues: map[string]int{}}
	var problems []string
	bad := 0
	var ids idSet
	decodeAll(lr, d, now, func(line int, t Task, err error) {
		if err != nil {
			bad++
			if len(problems) < maxProblems {
				problems = append(problems, fmt.Sprintf("line %d: %s", line, strings.ReplaceAll(err.Error(), "\n", "; ")))
			}
			return
		}
		if t.TaskID != "" {
			ids.add(t.Queue, t.TaskID)
		}
		if each != nil {
			t.Line = line
			each(t)
		}
		c.Tasks++
		c.LastLine = line
		if _, counted := c.Queues[t.Queue]; counted || known(t.Queue) || len(c.Queues) < maxQueueNames {
			c.Queues[t.Queue]++
		} else {
			c.More++
		}
	})
	if err := lr.err(); err != nil {
		return c, err
	}
	if ids.dups() {
		// Rare: a second reading finds which lines they are.
		dups, err := duplicateIDs(r, name, skip, d, now, &ids)
		if err != nil {
			return c, err
		}
		bad += len(dups)
		problems = slices.SortedFunc(slices.Values(append(problems, dups...)), compareLines)
		problems = problems[:min(len(problems), maxProblems)]
	}
	if bad > 0 {
		msg := fmt.Sprintf("%s has %s; nothing was enqueued:\n  %s", name, plural(bad, "bad line"), strings.Join(problems, "\n  "))
		if bad > len(problems) {
			msg += fmt.Sprintf("\n  and %d more", bad-len(problems))
		}
		return c, errors.New(msg)
	}
	return c, nil
}

// decodeBatch is how many lines decodeAll decodes at once: enough to keep
// the CPUs busy, few enough that a file of large lines is checked in a
// flat 60 MB (2,048 lines of 1.1 KB peaked at 64 MB; TestEnqueueFileMemory).
const decodeBatch = 256

// decodeAll decodes every line lr yields with DecodeLine, a batch at a
// time spread over the CPUs (decoding is most of what reading a file
// costs), and gives each to each, in order.
func decodeAll(lr *lineReader, d Defaults, now time.Time, each func(line int, t Task, err error)) {
	workers := runtime.GOMAXPROCS(0)
	raw, lines := make([][]byte, 0, decodeBatch), make([]int, 0, decodeBatch)
	tasks, errs := make([]Task, decodeBatch), make([]error, decodeBatch)
	for {
		raw, lines = raw[:0], lines[:0]
		for len(raw) < decodeBatch && lr.next() {
			raw, lines = append(raw, bytes.Clone(lr.data)), append(lines, lr.line)
		}
		var wg sync.WaitGroup
		for w := range min(workers, len(raw)) {
			wg.Go(func() {
				for i := w; i < len(raw); i += workers {
					tasks[i], errs[i] = DecodeLine(raw[i], d, now)
				}
			})
		}
		wg.Wait()
		for i := range raw {
			each(lines[i], tasks[i], errs[i])
			tasks[i], raw[i] = Task{}, nil // not kept until the next batch
		}
		if len(raw) < decodeBatch {
			return
		}
	}
}

// compareLines orders problems "line N: ..." by N.
func compareLines(a, b string) int {
	number := func(s string) int {
		n, _ := strconv.Atoi(strings.TrimPrefix(s[:strings.IndexByte(s, ':')], "line "))
		return n
	}
	return cmp.Compare(number(a), number(b))
}

// idSet holds a 64-bit fingerprint of each (queue, task id) of a file, in
// 8 bytes each: a task id is taken once per queue, and a file that gives
// one twice would see its second task counted as already enqueued.
type idSet struct {
	seed  maphash.Seed
	sums  []uint64
	dupOf map[uint64]bool // the fingerprints seen twice, after dups
}

func (s *idSet) add(queue, id string) {
	if s.sums == nil {
		s.seed = maphash.MakeSeed()
	}
	s.sums = append(s.sums, s.sum(queue, id))
}

func (s *idSet) sum(queue, id string) uint64 {
	var h maphash.Hash
	h.SetSeed(s.seed)
	h.WriteString(queue)
	h.WriteByte(0) // queue names hold no NUL: "a"+"b\x00c" differs from "a\x00b"+"c"
	h.WriteString(id)
	return h.Sum64()
}

// dups reports whether a fingerprint was added twice, and keeps those.
func (s *idSet) dups() bool {
	slices.Sort(s.sums)
	for i := 1; i < len(s.sums); i++ {
		if s.sums[i] == s.sums[i-1] {
			if s.dupOf == nil {
				s.dupOf = map[uint64]bool{}
			}
			s.dupOf[s.sums[i]] = true
		}
	}
	s.sums = nil
	return len(s.dupOf) > 0
}

// duplicateIDs reads r again from its start and returns a problem for
// each line whose task id an earlier line in the same queue has. Only
// lines whose fingerprints came twice are looked at, so a fingerprint
// shared by two different ids is no false alarm.
func duplicateIDs(r io.Reader, name string, skip int, d Defaults, now time.Time, ids *idSet) ([]string, error) {
	seeker, ok := r.(io.Seeker)
	if !ok {
		return nil, fmt.Errorf("reading %s again: it cannot be read twice", name)
	}
	if _, err := seeker.Seek(0, io.SeekStart); err != nil {
		return nil, fmt.Errorf("reading %s again: %w", name, err)
	}
	lr := newLineReader(r, name, skip)
	first := map[[2]string]int{}
	var problems []string
	for lr.next() {
		t, err := DecodeLine(lr.data, d, now)
		if err != nil || t.TaskID == "" || !ids.dupOf[ids.sum(t.Queue, t.TaskID)] {
			continue
		}
		key := [2]string{t.Queue, t.TaskID}
		if line, dup := first[key]; dup {
			problems = append(problems, fmt.Sprintf("line %d: task_id %q is also on line %d in queue %q: a task id is taken once per queue", lr.line, t.TaskID, line, t.Queue))
		} else {
			first[key] = lr.line
		}
	}
	return problems, lr.err()
}

// FileTasks returns the tasks of r, checked already by CheckTasks with the
// same arguments, one a call, each with its Line; ok is false at the end.
// It is Loader.Load's next. A line that no longer passes the check (the
// file changed between the two readings) is an error.
func FileTasks(r io.Reader, name string, skip int, d Defaults, now time.Time) func() (t Task, ok bool, err error) {
	lr := newLineReader(r, name, skip)
	return func() (Task, bool, error) {
		if !lr.next() {
			return Task{}, false, lr.err()
		}
		t, err := DecodeLine(lr.data, d, now)
		if err != nil {
			return Task{}, false, fmt.Errorf("%s: line %d changed after it was checked: %w", name, lr.line, err)
		}
		t.Line = lr.line
		return t, true, nil
	}
}
