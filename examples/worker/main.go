// Command worker is an example of a sluice worker with a task type of its
// own: forecast:fetch, which calls a weather API. Its queues, rates and
// quotas come from the config file, as for sluice's own worker.
//
//	go run ./examples/worker --config examples/config.yaml --api http://127.0.0.1:8000
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/sluicehq/sluice/examples/forecast"
	"github.com/sluicehq/sluice/worker"
)

func main() {
	configPath := flag.String("config", "config.yaml", "the sluice config file")
	api := flag.String("api", "http://127.0.0.1:8000", "the weather API's base URL")
	flag.Parse()

	w, err := worker.New(*configPath)
	if err != nil {
		fmt.Fprintln(os.Stderr, err) // every problem of the config, by key
		os.Exit(2)
	}
	w.Handle(forecast.TypeFetch, &forecast.Handler{BaseURL: *api})

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := w.Run(ctx); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}
