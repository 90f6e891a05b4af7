// Package test holds sluice's end-to-end tests: real worker processes, built
// from cmd/worker, examples/worker, test/panicworker and
// test/customerworker, against the real redis-server that `make test`
// starts, with a local HTTP server standing in for a third-party API.
//
// The helpers live by what they do: this file builds the binaries and
// writes the tests' files; workers_test.go starts workers; fleet_test.go
// runs a fleet on a backend; upstream_test.go is the stand-in API and its
// producers; producers_test.go runs enqueue and the intake;
// measure_test.go measures arrivals; docs_test.go reads the docs' snippets.
package test

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
)

// bin holds the binaries TestMain builds.
var bin string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "sluice-e2e-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	bin = dir
	// -buildvcs=auto: --version shows the revision where git can tell it,
	// whatever GOFLAGS says.
	for out, pkgs := range map[string][]string{dir + "/": {"../cmd/..."}, dir + "/examples/": {"../examples/..."}, dir + "/test/": {"./panicworker", "./customerworker"}} {
		build := exec.Command("go", append([]string{"build", "-buildvcs=auto", "-o", out}, pkgs...)...)
		build.Stdout, build.Stderr = os.Stdout, os.Stderr
		if err := build.Run(); err != nil {
			fmt.Fprintf(os.Stderr, "building %s: %v\n", pkgs, err)
			os.Exit(1)
		}
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// writeConfig writes a config file for the test and returns its path.
func writeConfig(t *testing.T, yaml string) string {
	t.Helper()
	return writeFile(t, "config.yaml", yaml)
}

// writeFile writes content to a file called name in a new directory and
// returns its path.
func writeFile(t *testing.T, name, content string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

// replace writes a file the way editors save: a new file renamed over it.
func replace(t *testing.T, path, content string) {
	t.Helper()
	tmp := path + ".new"
	if err := os.WriteFile(tmp, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}
