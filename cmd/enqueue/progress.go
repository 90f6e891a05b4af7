package main

import (
	"fmt"
	"io"
	"math"
	"sync/atomic"
	"time"

	"github.com/schollz/progressbar/v3"
	"golang.org/x/text/language"
	"golang.org/x/text/message"
)

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
