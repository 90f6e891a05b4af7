// Command panicworker is the example worker (examples/worker) with a handler
// that panics on demand, for the end-to-end tests: a forecast:fetch task
// whose city starts with "panic" panics in its handler before calling the
// API; every other one calls it as the example does. No built-in task type
// panics on demand, and a test must not need one that does.
//
//	panicworker --config config.yaml --api http://127.0.0.1:8000
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"github.com/hibiken/asynq"

	"github.com/sluicehq/sluice/examples/forecast"
	"github.com/sluicehq/sluice/worker"
)

func main() {
	configPath := flag.String("config", "config.yaml", "the sluice config file")
	api := flag.String("api", "http://127.0.0.1:8000", "the weather API's base URL")
	flag.Parse()

	w, err := worker.New(*configPath)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	fetch := &forecast.Handler{BaseURL: *api}
	w.Handle(forecast.TypeFetch, asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) error {
		var p forecast.Payload
		if json.Unmarshal(t.Payload(), &p) == nil && strings.HasPrefix(p.City, "panic") {
			panic("forecast for " + p.City + " blew up")
		}
		return fetch.ProcessTask(ctx, t)
	}))

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := w.Run(ctx); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}
