// Package forecast is the task type of sluice's examples: forecast:fetch
// asks a weather API for a city's forecast. examples/worker runs it on a
// sluice worker; examples/producer enqueues it with a plain asynq.Client.
package forecast

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/hibiken/asynq"

	"github.com/sluicehq/sluice/jobs"
)

// TypeFetch is the task type. Producers and the worker's config name it.
const TypeFetch = "forecast:fetch"

// Payload is a forecast:fetch task's payload; schema.json says the same for
// enqueue and the intake.
type Payload struct {
	City string `json:"city"`
}

// NewTask returns a forecast:fetch task for city.
func NewTask(city string, opts ...asynq.Option) (*asynq.Task, error) {
	if strings.TrimSpace(city) == "" {
		return nil, fmt.Errorf("%s: the city must not be empty", TypeFetch)
	}
	payload, err := json.Marshal(Payload{City: city})
	if err != nil {
		return nil, err
	}
	return asynq.NewTask(TypeFetch, payload, opts...), nil
}

// Handler fetches forecasts from the API at BaseURL: GET BaseURL/forecast/CITY.
type Handler struct {
	BaseURL string
	Client  *http.Client // nil: a client with a 10 s timeout
}

// ProcessTask implements asynq.Handler. A 429 or 503 from the API becomes
// sluice's upstream signal (*jobs.UpstreamBusyError): the quotas of the
// type stop for the API's Retry-After, fleet-wide, and the task waits for
// its next turn without losing a retry.
func (h *Handler) ProcessTask(ctx context.Context, t *asynq.Task) error {
	var p Payload
	if err := json.Unmarshal(t.Payload(), &p); err != nil || p.City == "" {
		// It would fail the same way every time.
		return fmt.Errorf("%s: payload %q: want {\"city\": \"...\"}: %w", TypeFetch, t.Payload(), asynq.SkipRetry)
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, h.BaseURL+"/forecast/"+url.PathEscape(p.City), nil)
	if err != nil {
		return fmt.Errorf("%s: %v: %w", TypeFetch, err, asynq.SkipRetry)
	}
	client := h.Client
	if client == nil {
		client = &http.Client{Timeout: 10 * time.Second}
	}
	resp, err := client.Do(req)
	if err != nil {
		return fmt.Errorf("%s: %w", TypeFetch, err)
	}
	defer resp.Body.Close()
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10)) // so the connection is reused
	if busy := jobs.UpstreamBusy(resp); busy != nil {
		return fmt.Errorf("%s %s: %w", TypeFetch, p.City, busy)
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s %s: %s", TypeFetch, p.City, resp.Status)
	}
	return nil
}
