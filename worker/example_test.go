package worker_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log"
	"os"
	"os/signal"
	"syscall"

	"github.com/hibiken/asynq"

	"github.com/sluicehq/sluice/worker"
)

// A worker for an email:send task type of your own. config.yaml names its
// queues, their drain rates and the quotas email:send draws on:
//
//	redis: {addr: 127.0.0.1:6379}
//	queues:
//	  emails: {drain: {limit: 20, period: 1s}}
//	quotas:
//	  mail-api: {limit: 100, period: 1m, burst: 10}
//	tasks:
//	  email:send: {quotas: [mail-api], schema: email.schema.json}
func Example() {
	w, err := worker.New("config.yaml")
	if err != nil {
		log.Fatal(err) // every problem of the config, by key
	}
	w.HandleFunc("email:send", func(ctx context.Context, t *asynq.Task) error {
		var email struct {
			To string `json:"to"`
		}
		if err := json.Unmarshal(t.Payload(), &email); err != nil {
			return fmt.Errorf("email:send: %v: %w", err, asynq.SkipRetry)
		}
		fmt.Println("sending to", email.To) // your mail API's call goes here
		return nil
	})

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := w.Run(ctx); err != nil { // until SIGINT or SIGTERM; running tasks finish
		log.Fatal(err)
	}
}
