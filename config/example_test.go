package config_test

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/sluicehq/sluice/config"
)

func ExampleLoad() {
	dir, _ := os.MkdirTemp("", "sluice")
	defer os.RemoveAll(dir)
	path := filepath.Join(dir, "config.yaml")
	os.WriteFile(path, []byte(`
worker: {concurency: 4, hold_max: 5}
queues:
  Emails: {priority: 2}
  reports: {drain: {limit: 0, period: 1s}}
`), 0o644)

	_, err := config.Load(path)
	var problems *config.Problems
	if errors.As(err, &problems) {
		for _, p := range problems.Errs {
			fmt.Println(p)
		}
	}
	// Output:
	// queues.Emails: names must be lower case (config keys are case-insensitive)
	// worker.concurency: unknown key; known keys here are concurrency, metrics_addr, hold_max, reserve_max, ui
	// worker.hold_max: must be a duration with a unit, like 1s, 500ms or 5m, got "5"
	// redis.addr: must be set to host:port, like 127.0.0.1:6379 (or set redis.cluster)
	// queues.reports.drain.limit: must be > 0, got 0
}
