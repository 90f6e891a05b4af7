package config

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/fsnotify/fsnotify"
)

// settle is how long the directory must be quiet before the file is read:
// editors save in several steps (truncate, write, rename).
const settle = 100 * time.Millisecond

// Watch reloads the config file at path with Load whenever its content
// changes, and calls onChange with the new File if it has no problems, else
// onError with the error (a *Problems, or a read error); the caller keeps the
// last good File in force. It also reports watch failures to onError.
//
// Watch is watching when it returns; call it right after Load. The callbacks
// run one at a time on a goroutine of Watch's until ctx is done.
//
// It watches the file's directory, not the file: editors and tools replace a
// file by renaming a new one over it (and Kubernetes swaps a symlink), which
// a watch on the file itself would not survive. After each burst of events
// it rereads the file and reloads only if the bytes differ.
func Watch(ctx context.Context, path string, onChange func(File), onError func(error)) {
	w, err := fsnotify.NewWatcher()
	if err == nil {
		err = w.Add(filepath.Dir(path))
	}
	if err != nil {
		if w != nil {
			w.Close()
		}
		onError(fmt.Errorf("config: watch %s: %w", path, err))
		return
	}
	last, _ := os.ReadFile(path)
	go func() {
		defer w.Close()
		var quiet <-chan time.Time
		for {
			select {
			case <-ctx.Done():
				return
			case err := <-w.Errors:
				onError(fmt.Errorf("config: watch %s: %w", path, err))
			case <-w.Events:
				quiet = time.After(settle)
			case <-quiet:
				quiet = nil
				data, err := os.ReadFile(path)
				if err != nil {
					last = nil
					onError(fmt.Errorf("config: %w", err))
					continue
				}
				if bytes.Equal(data, last) {
					continue
				}
				last = data
				if f, err := load(path, data); err != nil {
					onError(err)
				} else {
					onChange(f)
				}
			}
		}
	}()
}
