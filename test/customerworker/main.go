// Command customerworker is a user's worker for the end-to-end tests, as
// a team would write it on package worker: crm:sync tasks each sync one
// record of a customer through a CRM that limits every customer's token,
// and a 429 from the CRM goes back to sluice as jobs.UpstreamBusy says.
//
//	customerworker --config config.yaml --crm http://127.0.0.1:8000
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/hibiken/asynq"

	"github.com/sluicehq/sluice/jobs"
	"github.com/sluicehq/sluice/worker"
)

// typeSync is the task type: payload {"customer", "token", "record"}.
const typeSync = "crm:sync"

type payload struct {
	Customer string `json:"customer"`
	Token    string `json:"token"`
	Record   string `json:"record"`
}

func main() {
	configPath := flag.String("config", "config.yaml", "the sluice config file")
	crm := flag.String("crm", "http://127.0.0.1:8000", "the CRM's base URL")
	flag.Parse()

	w, err := worker.New(*configPath)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	client := &http.Client{Timeout: 10 * time.Second}
	w.HandleFunc(typeSync, func(ctx context.Context, t *asynq.Task) error {
		var p payload
		if err := json.Unmarshal(t.Payload(), &p); err != nil {
			return fmt.Errorf("%s: %v: %w", typeSync, err, asynq.SkipRetry)
		}
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, *crm+"/sync/"+url.PathEscape(p.Customer)+"/"+url.PathEscape(p.Record), nil)
		if err != nil {
			return fmt.Errorf("%s: %v: %w", typeSync, err, asynq.SkipRetry)
		}
		req.Header.Set("Authorization", "Bearer "+p.Token)
		resp, err := client.Do(req)
		if err != nil {
			return fmt.Errorf("%s: %w", typeSync, err)
		}
		defer resp.Body.Close()
		_, _ = io.Copy(io.Discard, resp.Body)
		if busy := jobs.UpstreamBusy(resp); busy != nil {
			return fmt.Errorf("%s %s: %w", typeSync, p.Customer, busy)
		}
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("%s %s: %s", typeSync, p.Customer, resp.Status)
		}
		return nil
	})

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := w.Run(ctx); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}
