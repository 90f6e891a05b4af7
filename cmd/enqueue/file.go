package main

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"strings"
	"sync/atomic"
	"time"

	"github.com/schollz/progressbar/v3"
	"golang.org/x/text/language"
	"golang.org/x/text/message"
)

const (
	// maxLine is the longest line --file takes.
	maxLine = 16 << 20
	// maxProblems is how many bad lines are shown; the rest are counted.
	maxProblems = 20
)

func openFile(path string) (*os.File, error) {
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

// readTasks reads and checks every task of r, JSON Lines named name,
// after its first skip lines. Blank lines are skipped, and lines keep their
// numbers in the input. If any line is bad, it returns no tasks and an
// error that names the first maxProblems bad lines and counts the rest.
func readTasks(r io.Reader, name string, skip int, d lineDefaults, now time.Time) ([]task, error) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64<<10), maxLine)
	var tasks []task
	var problems []string
	bad := 0
	ids := map[[2]string]int{} // queue and task id -> line
	line := 0
	for sc.Scan() {
		line++
		data := sc.Bytes()
		if line <= skip || len(bytes.TrimSpace(data)) == 0 {
			continue
		}
		t, err := decodeLine(data, d, now)
		if err == nil && t.taskID != "" {
			key := [2]string{t.queue, t.taskID}
			if first, dup := ids[key]; dup {
				err = fmt.Errorf("task_id %q is also on line %d in queue %q: a task id is taken once per queue", t.taskID, first, t.queue)
			} else {
				ids[key] = line
			}
		}
		if err != nil {
			bad++
			if len(problems) < maxProblems {
				problems = append(problems, fmt.Sprintf("line %d: %s", line, strings.ReplaceAll(err.Error(), "\n", "; ")))
			}
			continue
		}
		t.line = line
		tasks = append(tasks, t)
	}
	switch err := sc.Err(); {
	case errors.Is(err, bufio.ErrTooLong):
		return nil, fmt.Errorf("%s: line %d is longer than %d MiB; nothing was enqueued", name, line+1, maxLine>>20)
	case err != nil:
		return nil, fmt.Errorf("reading %s: %w; nothing was enqueued", name, err)
	case skip > line:
		return nil, fmt.Errorf("--skip %d: %s has only %d lines", skip, name, line)
	case bad > 0:
		msg := fmt.Sprintf("%s has %s; nothing was enqueued:\n  %s", name, plural(bad, "bad line"), strings.Join(problems, "\n  "))
		if bad > len(problems) {
			msg += fmt.Sprintf("\n  and %d more", bad-len(problems))
		}
		return nil, errors.New(msg)
	}
	return tasks, nil
}

// showProgress shows done of total on w until the returned stop is called:
// a bar on a terminal, else a line a second.
func showProgress(w io.Writer, total int, done *atomic.Int64) (stop func()) {
	quit, stopped := make(chan struct{}), make(chan struct{})
	if isTerminal(w) {
		bar := progressbar.NewOptions64(int64(total),
			progressbar.OptionSetWriter(w),
			progressbar.OptionSetDescription("enqueue"),
			progressbar.OptionShowCount(),
			progressbar.OptionShowIts(),
			progressbar.OptionSetItsString("tasks"),
			progressbar.OptionThrottle(100*time.Millisecond),
			progressbar.OptionClearOnFinish(),
			progressbar.OptionSetRenderBlankState(true), // starts its clock now; else the first rate is over microseconds
		)
		go func() {
			defer close(stopped)
			tick := time.NewTicker(100 * time.Millisecond)
			defer tick.Stop()
			for {
				select {
				case <-tick.C:
					bar.Set64(done.Load())
				case <-quit:
					bar.Set64(done.Load())
					if !bar.IsFinished() {
						bar.Exit()
						fmt.Fprintln(w)
					}
					return
				}
			}
		}()
	} else {
		go func() {
			defer close(stopped)
			start := time.Now()
			tick := time.NewTicker(time.Second)
			defer tick.Stop()
			for {
				select {
				case <-tick.C:
					n := done.Load()
					fmt.Fprintf(w, "enqueue: %d/%d enqueued (%s tasks/s)\n", n, total, grouped(float64(n)/time.Since(start).Seconds()))
				case <-quit:
					return
				}
			}
		}()
	}
	return func() {
		close(quit)
		<-stopped
	}
}

// grouped formats x rounded to an integer with thousands separators: 41,230.
func grouped(x float64) string {
	return message.NewPrinter(language.English).Sprintf("%d", int64(math.Round(x)))
}
