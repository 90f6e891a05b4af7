package config

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func TestWatch(t *testing.T) {
	config := func(concurrency string) string {
		return "redis: {addr: 127.0.0.1:6379}\nworker: {concurrency: " + concurrency + "}\n"
	}
	path := write(t, config("1"))
	changes, errs := watchEvents(t, path)

	inPlace := func(content string) error { return os.WriteFile(path, []byte(content), 0o644) }
	// What editors do: write a new file beside the old one, rename it over.
	replace := func(content string) error {
		tmp := filepath.Join(filepath.Dir(path), ".config.yaml.swp")
		if err := os.WriteFile(tmp, []byte(content), 0o644); err != nil {
			return err
		}
		return os.Rename(tmp, path)
	}
	// Steps run in order on one watch.
	for _, tt := range []struct {
		desc            string
		write           func(string) error
		content         string
		wantConcurrency int    // 0: no change expected
		wantErr         string // the refusal names this line, key and problem
	}{
		{desc: "good change in place", write: inPlace, content: config("2"), wantConcurrency: 2},
		{desc: "bad change in place", write: inPlace, content: config("two"), wantErr: `config.yaml:2: worker.concurrency: must be a whole number, got "two"`},
		{desc: "good change by rename", write: replace, content: config("3"), wantConcurrency: 3},
		{desc: "bad change by rename", write: replace, content: config("-1"), wantErr: "config.yaml:2: worker.concurrency: must be >= 1"},
		{desc: "good change after a bad one", write: replace, content: config("4"), wantConcurrency: 4},
	} {
		if err := tt.write(tt.content); err != nil {
			t.Fatal(err)
		}
		select {
		case f := <-changes:
			if f.Jobs.Worker.Concurrency != tt.wantConcurrency {
				t.Fatalf("%s: onChange with concurrency %d, want %d", tt.desc, f.Jobs.Worker.Concurrency, tt.wantConcurrency)
			}
		case err := <-errs:
			var p *Problems
			if tt.wantErr == "" || !errors.As(err, &p) || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("%s: onError(%v), want a problem naming %q", tt.desc, err, tt.wantErr)
			}
		case <-time.After(2 * time.Second):
			// A bad change is reported once it reads the same a second
			// later (confirm): a save in place may be caught mid-way.
			t.Fatalf("%s: no callback within 2s", tt.desc)
		}
	}
	// A rewrite with the same bytes is not a change.
	if err := replace(config("4")); err != nil {
		t.Fatal(err)
	}
	select {
	case f := <-changes:
		t.Errorf("onChange(%+v) for an unchanged file", f.Jobs.Worker)
	case err := <-errs:
		t.Errorf("onError(%v) for an unchanged file", err)
	case <-time.After(300 * time.Millisecond):
	}
}

// watchEvents runs Watch on path and returns its callbacks as channels.
func watchEvents(t *testing.T, path string) (<-chan File, <-chan error) {
	t.Helper()
	loaded, err := Load(path)
	if err != nil {
		t.Fatal(err)
	}
	return watchLoaded(t, path, loaded)
}

// watchLoaded runs Watch on path, loaded by Load already.
func watchLoaded(t *testing.T, path string, loaded File) (<-chan File, <-chan error) {
	t.Helper()
	changes := make(chan File, 10)
	errs := make(chan error, 10)
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	Watch(ctx, path, loaded, func(f File) { changes <- f }, func(err error) { errs <- err })
	return changes, errs
}

// waitConcurrency waits up to within for a reload that sets
// worker.concurrency to want, and returns how long it took.
func waitConcurrency(t *testing.T, changes <-chan File, errs <-chan error, want int, within time.Duration) time.Duration {
	t.Helper()
	start := time.Now()
	for {
		select {
		case f := <-changes:
			if f.Jobs.Worker.Concurrency == want {
				return time.Since(start)
			}
		case err := <-errs:
			t.Fatalf("onError(%v), want a reload with concurrency %d", err, want)
		case <-time.After(within - time.Since(start)):
			t.Fatalf("no reload with concurrency %d within %v", want, within)
		}
	}
}

func concurrencyConfig(n int) string {
	return fmt.Sprintf("redis: {addr: 127.0.0.1:6379}\nworker: {concurrency: %d}\n", n)
}

// TestWatchBusyDirectory: another file in the config's directory written
// every 50 ms (a log file beside the config) does not hold a reload back.
func TestWatchBusyDirectory(t *testing.T) {
	path := write(t, concurrencyConfig(1))
	changes, errs := watchEvents(t, path)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		logFile, err := os.Create(filepath.Join(filepath.Dir(path), "worker.log"))
		if err != nil {
			return
		}
		defer logFile.Close()
		tick := time.NewTicker(50 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
				fmt.Fprintln(logFile, "a line of log")
			}
		}
	}()
	defer func() { cancel(); <-done }()
	time.Sleep(200 * time.Millisecond)
	if err := os.WriteFile(path, []byte(concurrencyConfig(2)), 0o644); err != nil {
		t.Fatal(err)
	}
	took := waitConcurrency(t, changes, errs, 2, 2*time.Second)
	t.Logf("reloaded %v after the edit, with another file written every 50ms", took.Round(time.Millisecond))
	if took > 700*time.Millisecond {
		t.Errorf("reload took %v with a busy directory, want well under 2s (at most 700ms)", took)
	}
}

// TestWatchSettleCapped: a config file written again and again (every
// 50 ms) is still reloaded within the cap, not only once the writes stop.
func TestWatchSettleCapped(t *testing.T) {
	path := write(t, concurrencyConfig(1))
	changes, errs := watchEvents(t, path)
	start := time.Now()
	stop := time.After(2 * time.Second)
	var took time.Duration
	for n := 2; took == 0; n++ {
		if err := os.WriteFile(path, []byte(concurrencyConfig(n)), 0o644); err != nil {
			t.Fatal(err)
		}
		select {
		case <-changes:
			took = time.Since(start)
		case err := <-errs:
			t.Fatalf("onError(%v)", err)
		case <-stop:
			t.Fatalf("no reload within 2s while the file was written every 50ms")
		case <-time.After(50 * time.Millisecond):
		}
	}
	t.Logf("first reload %v after writes every 50ms began", took.Round(time.Millisecond))
	if took > time.Second {
		t.Errorf("first reload after %v of writes every 50ms, want within 1s", took)
	}
}

// TestWatchCappedMidSave: a file saved again and again in two steps
// (truncated, then written a moment later, as a tool that rewrites in place
// does) is reloaded by the cap without an error for the empty file seen
// between the steps: a read that finds no valid config while the file is
// still being written is read again, and only a file that has been quiet
// for the settle time reports its problems. On a busy disk the empty
// moment is most of the save: the watcher then read the empty file twice
// with events between, and reported it.
func TestWatchCappedMidSave(t *testing.T) {
	for _, empty := range []time.Duration{10 * time.Millisecond, 35 * time.Millisecond} {
		t.Run(fmt.Sprintf("empty %v of every 50ms", empty), func(t *testing.T) {
			path := write(t, concurrencyConfig(1))
			changes, errs := watchEvents(t, path)
			stop := time.After(2 * time.Second)
			reloads := 0
			for n := 2; ; n++ {
				f, err := os.OpenFile(path, os.O_WRONLY|os.O_TRUNC, 0o644)
				if err != nil {
					t.Fatal(err)
				}
				time.Sleep(empty)
				if _, err := f.WriteString(concurrencyConfig(n)); err != nil {
					t.Fatal(err)
				}
				f.Close()
				select {
				case <-changes:
					reloads++
				case err := <-errs:
					t.Fatalf("onError(%v) while the file was being saved every 50ms", err)
				case <-stop:
					if reloads == 0 {
						t.Fatal("no reload within 2s while the file was saved every 50ms")
					}
					t.Logf("%d reloads in 2s of saves every 50ms, no error", reloads)
					return
				case <-time.After(50*time.Millisecond - empty):
				}
			}
		})
	}
}

// TestWatchSymlink: a config that is a symlink into another directory is
// reloaded when its target changes, in place or replaced, and when the
// link is swapped to another target (as Kubernetes updates a ConfigMap).
func TestWatchSymlink(t *testing.T) {
	targetDir, linkDir := t.TempDir(), t.TempDir()
	target := filepath.Join(targetDir, "real.yaml")
	if err := os.WriteFile(target, []byte(concurrencyConfig(1)), 0o644); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(linkDir, "config.yaml")
	if err := os.Symlink(target, path); err != nil {
		t.Fatal(err)
	}
	changes, errs := watchEvents(t, path)

	if err := os.WriteFile(target, []byte(concurrencyConfig(2)), 0o644); err != nil {
		t.Fatal(err)
	}
	waitConcurrency(t, changes, errs, 2, time.Second)

	tmp := filepath.Join(targetDir, ".real.yaml.swp")
	if err := os.WriteFile(tmp, []byte(concurrencyConfig(3)), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, target); err != nil {
		t.Fatal(err)
	}
	waitConcurrency(t, changes, errs, 3, time.Second)

	other := filepath.Join(t.TempDir(), "other.yaml")
	if err := os.WriteFile(other, []byte(concurrencyConfig(4)), 0o644); err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(linkDir, ".config.yaml.new")
	if err := os.Symlink(other, link); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(link, path); err != nil {
		t.Fatal(err)
	}
	waitConcurrency(t, changes, errs, 4, time.Second)

	// The new target is watched from then on.
	if err := os.WriteFile(other, []byte(concurrencyConfig(5)), 0o644); err != nil {
		t.Fatal(err)
	}
	waitConcurrency(t, changes, errs, 5, time.Second)
}

// TestWatchChangeBeforeStart: a change made after Load read the file but
// before Watch started is reloaded; an unchanged file is not.
func TestWatchChangeBeforeStart(t *testing.T) {
	path := write(t, concurrencyConfig(1))
	loaded, err := Load(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte(concurrencyConfig(2)), 0o644); err != nil {
		t.Fatal(err)
	}
	changes, errs := watchLoaded(t, path, loaded)
	waitConcurrency(t, changes, errs, 2, time.Second)

	unchanged := write(t, concurrencyConfig(3))
	changes, errs = watchEvents(t, unchanged)
	select {
	case f := <-changes:
		t.Errorf("onChange(%+v) for a file unchanged since Load", f.Jobs.Worker)
	case err := <-errs:
		t.Errorf("onError(%v) for a file unchanged since Load", err)
	case <-time.After(300 * time.Millisecond):
	}
}
