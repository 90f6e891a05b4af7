package config

import (
	"context"
	"crypto/sha256"
	"fmt"
	"path/filepath"
	"time"

	"github.com/fsnotify/fsnotify"
)

const (
	// settle is how long the file must be quiet before it is read: editors
	// save in several steps (truncate, write, rename).
	settle = 100 * time.Millisecond
	// maxSettle caps the wait from a burst's first event: a file written
	// again and again is still read, not only once the writes stop.
	maxSettle = 500 * time.Millisecond
	// confirm is how long a file that cannot be read or loaded must stay
	// so before it is reported: a save in place is a truncate then a
	// write, and on a busy disk the truncate alone was seen to take 450 ms,
	// the file empty all along, with no event until it ended.
	confirm = time.Second
)

// Watch reloads the config file at path with Load whenever its content
// changes, and calls onChange with the new File if it has no problems, else
// onError with the error (a *Problems, or a read error); the caller keeps the
// last good File in force. It also reports watch failures to onError.
//
// loaded is the File that Load returned for path: a change made after Load
// read the file, even before Watch started, is reloaded at once. (A File
// not from Load counts as out of date: the file is loaded once at start.)
// Watch is watching when it returns. The callbacks run one at a time on a
// goroutine of Watch's until ctx is done.
//
// It watches the file's directory, not the file: editors and tools replace a
// file by renaming a new one over it, which a watch on the file itself would
// not survive. When path is a symlink, the directory of its target is
// watched too, and a swapped link (as Kubernetes updates a ConfigMap) moves
// the watch to the new target's directory. Only events of the file itself,
// of its target, or that change where path leads count: other files in
// those directories, however busy, do not delay a reload. After the events
// settle (100 ms of quiet, at most 500 ms from the first) the file is read
// and reloaded if its bytes differ from the last read.
func Watch(ctx context.Context, path string, loaded File, onChange func(File), onError func(error)) {
	fw, err := fsnotify.NewWatcher()
	if err == nil {
		err = fw.Add(filepath.Dir(path))
	}
	if err != nil {
		if fw != nil {
			fw.Close()
		}
		onError(fmt.Errorf("config: watch %s: %w", path, err))
		return
	}
	w := &watcher{fsw: fw, path: filepath.Clean(path), last: loaded.digest}
	w.follow(onError)
	// A change between Load and the watch above would raise no event.
	current, err := readFile(path)
	stale := err != nil || sha256.Sum256(current) != loaded.digest
	go w.run(ctx, stale, onChange, onError)
}

// watcher is the state of one Watch.
type watcher struct {
	fsw    *fsnotify.Watcher
	path   string // as given, cleaned
	target string // where path leads, symlinks resolved; "" if it leads nowhere now
	extra  string // the target's directory, when it is not path's and is watched
	last   [sha256.Size]byte
	// unconfirmed is the digest of content that did not load, read once:
	// reported if it reads the same confirm later, with no event between
	// (confirming). readFailed: the same for a read that failed.
	unconfirmed [sha256.Size]byte
	readFailed  bool
	confirming  bool
}

// follow resolves path again and moves the watch of the target's directory
// if the target moved to another one. It reports whether the target changed.
func (w *watcher) follow(onError func(error)) bool {
	target, err := filepath.EvalSymlinks(w.path)
	if err != nil {
		target = "" // missing for now (mid-save): the next event tells
	}
	if target == w.target {
		return false
	}
	w.target = target
	dir := ""
	if target != "" && filepath.Dir(target) != filepath.Dir(w.path) {
		dir = filepath.Dir(target)
	}
	if dir != w.extra {
		if w.extra != "" {
			_ = w.fsw.Remove(w.extra) // gone with its directory, perhaps
		}
		w.extra = ""
		if dir != "" {
			if err := w.fsw.Add(dir); err != nil {
				onError(fmt.Errorf("config: watch %s (the target of %s): %w", dir, w.path, err))
			} else {
				w.extra = dir
			}
		}
	}
	return true
}

// counts reports whether ev may have changed what path holds.
func (w *watcher) counts(ev fsnotify.Event, onError func(error)) bool {
	name := filepath.Clean(ev.Name)
	moved := w.follow(onError)
	return moved || name == w.path || name == w.target
}

func (w *watcher) run(ctx context.Context, stale bool, onChange func(File), onError func(error)) {
	defer w.fsw.Close()
	var quiet <-chan time.Time
	var burst time.Time // the first event of the burst being settled
	if stale {
		burst, quiet = time.Now(), time.After(0)
	}
	for {
		select {
		case <-ctx.Done():
			return
		case err := <-w.fsw.Errors:
			onError(fmt.Errorf("config: watch %s: %w", w.path, err))
		case ev := <-w.fsw.Events:
			if !w.counts(ev, onError) {
				continue
			}
			// The file is still being written: what did not load may be
			// a moment of the save, not its end.
			w.confirming = false
			now := time.Now()
			if quiet == nil {
				burst = now
			}
			quiet = time.After(min(settle, burst.Add(maxSettle).Sub(now)))
		case <-quiet:
			quiet = nil
			// A file that cannot be read or loaded may be mid-save (between
			// a truncate and its write, or a remove and a rename): it is
			// read again after confirm (or at the next event), and reported
			// only if it reads the same then, no event having come between:
			// a file saved again and again is empty now and then.
			data, err := readFile(w.path)
			if err != nil {
				if !w.readFailed || !w.confirming {
					w.readFailed, w.confirming, quiet = true, true, time.After(confirm)
					continue
				}
				w.readFailed, w.confirming, w.last = false, false, [sha256.Size]byte{}
				onError(fmt.Errorf("config: %w", err))
				continue
			}
			w.readFailed = false
			digest := sha256.Sum256(data)
			if digest == w.last {
				continue
			}
			f, err := load(w.path, data)
			if err != nil && (digest != w.unconfirmed || !w.confirming) {
				w.unconfirmed, w.confirming, quiet = digest, true, time.After(confirm)
				continue
			}
			w.last, w.unconfirmed, w.confirming = digest, [sha256.Size]byte{}, false
			if err != nil {
				onError(err)
			} else {
				onChange(f)
			}
		}
	}
}
