package forecast

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/sluicehq/sluice/config"
	"github.com/sluicehq/sluice/jobs"
)

func TestHandler(t *testing.T) {
	for _, tt := range []struct {
		desc       string
		status     int
		retryAfter string
		payload    string
		wantBusy   time.Duration // > 0: an UpstreamBusyError with this RetryAfter
		wantSkip   bool          // asynq.SkipRetry: it would fail the same way again
		wantErr    bool
	}{
		{desc: "ok", status: 200, payload: `{"city": "Paris"}`},
		{desc: "429 is the upstream signal", status: 429, retryAfter: "3", payload: `{"city": "Paris"}`, wantBusy: 3 * time.Second, wantErr: true},
		{desc: "503 too", status: 503, retryAfter: "1", payload: `{"city": "Paris"}`, wantBusy: time.Second, wantErr: true},
		{desc: "500 fails and is retried", status: 500, payload: `{"city": "Paris"}`, wantErr: true},
		{desc: "bad payload is not retried", status: 200, payload: `{"town": "Paris"}`, wantSkip: true, wantErr: true},
	} {
		var path string
		api := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			path = r.URL.Path
			if tt.retryAfter != "" {
				w.Header().Set("Retry-After", tt.retryAfter)
			}
			w.WriteHeader(tt.status)
		}))
		h := &Handler{BaseURL: api.URL}
		err := h.ProcessTask(context.Background(), asynq.NewTask(TypeFetch, []byte(tt.payload)))
		api.Close()
		var busy *jobs.UpstreamBusyError
		switch {
		case (err != nil) != tt.wantErr:
			t.Errorf("%s: ProcessTask() = %v, want error %v", tt.desc, err, tt.wantErr)
		case tt.wantBusy > 0 && (!errors.As(err, &busy) || busy.RetryAfter != tt.wantBusy):
			t.Errorf("%s: ProcessTask() = %v, want an UpstreamBusyError with RetryAfter %v", tt.desc, err, tt.wantBusy)
		case tt.wantBusy == 0 && errors.As(err, &busy):
			t.Errorf("%s: ProcessTask() = %v, want no upstream signal", tt.desc, err)
		case errors.Is(err, asynq.SkipRetry) != tt.wantSkip:
			t.Errorf("%s: ProcessTask() = %v, want SkipRetry %v", tt.desc, err, tt.wantSkip)
		case !tt.wantSkip && path != "/forecast/Paris":
			t.Errorf("%s: the API was asked for %q, want /forecast/Paris", tt.desc, path)
		}
	}
}

func TestNewTask(t *testing.T) {
	task, err := NewTask("São Paulo")
	if err != nil || task.Type() != TypeFetch || string(task.Payload()) != `{"city":"São Paulo"}` {
		t.Errorf("NewTask(São Paulo) = %v %s, %v", task.Type(), task.Payload(), err)
	}
	if _, err := NewTask(" "); err == nil {
		t.Error("NewTask(blank) succeeded, want an error")
	}
}

// TestExampleConfig: examples/config.yaml loads, and its schema takes the
// payloads NewTask makes and refuses others.
func TestExampleConfig(t *testing.T) {
	f, err := config.Load("../config.yaml")
	if err != nil {
		t.Fatal(err)
	}
	task, err := NewTask("Paris")
	if err != nil {
		t.Fatal(err)
	}
	if err := f.CheckPayload(TypeFetch, task.Payload()); err != nil {
		t.Errorf("CheckPayload(NewTask's payload) = %v", err)
	}
	if err := f.CheckPayload(TypeFetch, []byte(`{"city": ""}`)); err == nil || !strings.Contains(err.Error(), "/city") {
		t.Errorf("CheckPayload(an empty city) = %v, want an error naming /city", err)
	}
}
