// Package testkit holds what tests across sluice's packages share beyond
// Redis (see redistest): a clock they move by hand, polling for a
// condition, noting and measuring a timeline, a log buffer, and a certificate authority
// for TLS.
package testkit

import (
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
)

// Clock is a clock that stands where the test puts it: a throttle.Clock,
// and a jobs.Clock whose waits end when the test moves it past them.
type Clock struct {
	mu      sync.Mutex
	now     time.Time
	waiters []waiter
}

type waiter struct {
	at time.Time
	ch chan time.Time
}

// NewClock returns a Clock at t.
func NewClock(t time.Time) *Clock { return &Clock{now: t} }

// Now returns the time the test set.
func (c *Clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

// After returns a channel that gets the time once the clock has been moved
// d or more past now.
func (c *Clock) After(d time.Duration) <-chan time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	ch := make(chan time.Time, 1)
	if d <= 0 {
		ch <- c.now
		return ch
	}
	c.waiters = append(c.waiters, waiter{c.now.Add(d), ch})
	return ch
}

// Waiting is how many waits (After) have not ended yet.
func (c *Clock) Waiting() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.waiters)
}

// Set moves the clock to t, ending the waits due by then.
func (c *Clock) Set(t time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = t
	kept := c.waiters[:0]
	for _, w := range c.waiters {
		if w.at.After(t) {
			kept = append(kept, w)
		} else {
			w.ch <- t
		}
	}
	c.waiters = kept
}

// Add moves the clock by d.
func (c *Clock) Add(d time.Duration) { c.Set(c.Now().Add(d)) }

// WaitFor polls done every 20ms until it holds, or fails the test after d.
func WaitFor(tb testing.TB, d time.Duration, what string, done func() bool) {
	tb.Helper()
	deadline := time.Now().Add(d)
	for !done() {
		if time.Now().After(deadline) {
			tb.Fatalf("gave up after %v waiting for %s", d, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// MaxInWindow is the most of the sorted times that fall in any window of
// length d.
func MaxInWindow(times []time.Time, d time.Duration) int {
	most, _ := DensestWindow(times, d)
	return most
}

// DensestWindow is MaxInWindow's count and the index of the first of the
// times in the window that holds it.
func DensestWindow(times []time.Time, d time.Duration) (most, from int) {
	first := 0
	for last := range times {
		for times[last].Sub(times[first]) >= d {
			first++
		}
		if last-first+1 > most {
			most, from = last-first+1, first
		}
	}
	return most, from
}

// Gaps lists the gaps between consecutive times from index from, count of
// them, in whole milliseconds: what a test shows when a window holds too
// many (jitter bunches arrivals; two turns alike show as a gap of 0).
func Gaps(times []time.Time, from, count int) []int64 {
	var gaps []int64
	for i := from + 1; i < min(len(times), from+count); i++ {
		gaps = append(gaps, times[i].Sub(times[i-1]).Milliseconds())
	}
	return gaps
}

// Timeline notes when things happened, by key (a task, a request path);
// safe for concurrent use.
type Timeline struct {
	mu sync.Mutex
	at map[string][]time.Time
}

// Note records that key happened now.
func (tl *Timeline) Note(key string) {
	tl.mu.Lock()
	defer tl.mu.Unlock()
	if tl.at == nil {
		tl.at = map[string][]time.Time{}
	}
	tl.at[key] = append(tl.at[key], time.Now())
}

// All returns every time noted, sorted.
func (tl *Timeline) All() []time.Time {
	return tl.Matching(func(string) bool { return true })
}

// Matching returns the times noted under the keys for which match holds,
// sorted.
func (tl *Timeline) Matching(match func(key string) bool) []time.Time {
	tl.mu.Lock()
	defer tl.mu.Unlock()
	var all []time.Time
	for key, ts := range tl.at {
		if match(key) {
			all = append(all, ts...)
		}
	}
	slices.SortFunc(all, time.Time.Compare)
	return all
}

// Distinct is how many different keys were noted.
func (tl *Timeline) Distinct() int {
	tl.mu.Lock()
	defer tl.mu.Unlock()
	return len(tl.at)
}

// SyncBuffer is a log's output that a test reads while the code under
// test writes it.
type SyncBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (s *SyncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *SyncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}
