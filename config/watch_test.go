package config

import (
	"context"
	"errors"
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
	changes := make(chan File, 10)
	errs := make(chan error, 10)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	Watch(ctx, path, func(f File) { changes <- f }, func(err error) { errs <- err })

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
		wantErr         string // the refusal names this key
	}{
		{desc: "good change in place", write: inPlace, content: config("2"), wantConcurrency: 2},
		{desc: "bad change in place", write: inPlace, content: config("two"), wantErr: "worker.concurrency"},
		{desc: "good change by rename", write: replace, content: config("3"), wantConcurrency: 3},
		{desc: "bad change by rename", write: replace, content: config("-1"), wantErr: "worker.concurrency: must be >= 1"},
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
		case <-time.After(time.Second):
			t.Fatalf("%s: no callback within 1s", tt.desc)
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
