// The stand-in for a third-party API that http:request tasks call, and the
// plain asynq producers that enqueue those tasks.

package test

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/sluicehq/sluice/internal/redistest"
	"github.com/sluicehq/sluice/internal/testkit"
	"github.com/sluicehq/sluice/jobs"
)

// upstream is a local HTTP server standing in for a third-party API: it
// notes the time of every request, and answers with what respond says.
type upstream struct {
	*httptest.Server
	testkit.Timeline // arrivals by path
	mu               sync.Mutex
	respond          func(n int) (status int, retryAfter string)
	// respondTo, if set, answers instead of respond, by the request's path;
	// it is called under mu, one request at a time.
	respondTo func(path string) (status int, retryAfter string)
	n         int
}

// allowYAML is the http section of a config that lets http:request call u.
func (u *upstream) allowYAML() string {
	return fmt.Sprintf("http: {allow: ['%s']}\n", u.Listener.Addr())
}

// Under returns the arrival times of the requests whose path is under
// /prefix/, sorted.
func (u *upstream) Under(prefix string) []time.Time {
	return u.Matching(func(path string) bool { return strings.HasPrefix(path, "/"+prefix+"/") })
}

func newUpstream(t *testing.T) *upstream {
	u := &upstream{}
	u.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		u.Note(r.URL.Path)
		u.mu.Lock()
		u.n++
		n, respond := u.n, u.respond
		if u.respondTo != nil {
			status, retryAfter := u.respondTo(r.URL.Path)
			respond = func(int) (int, string) { return status, retryAfter }
		}
		u.mu.Unlock()
		if respond != nil {
			if status, retryAfter := respond(n); status != http.StatusOK {
				if retryAfter != "" {
					w.Header().Set("Retry-After", retryAfter)
				}
				w.WriteHeader(status)
				return
			}
		}
		w.WriteHeader(http.StatusOK)
	}))
	t.Cleanup(u.Close)
	return u
}

// enqueueRequests enqueues n http:request tasks into queue with a plain
// asynq.Client, each calling u at its own path; every other one has
// MaxRetry 0, which the asynq wiki's throttling pattern would archive.
func enqueueRequests(t *testing.T, u *upstream, queue, prefix string, n int) {
	t.Helper()
	enqueueRequestsOn(t, asynq.RedisClientOpt{Addr: redistest.Addr(t)}, u, queue, prefix, n)
}

// enqueueRequestsOn is enqueueRequests on the Redis of opt.
func enqueueRequestsOn(t *testing.T, opt asynq.RedisConnOpt, u *upstream, queue, prefix string, n int) {
	t.Helper()
	client := asynq.NewClient(opt)
	defer client.Close()
	enqueueWithHeaders(t, client, u.URL, queue, prefix, n, nil)
}

// enqueueWithHeaders puts n http:request tasks into queue, each calling
// base at its own path under prefix with the headers, every other one with
// MaxRetry 0.
func enqueueWithHeaders(t *testing.T, client *asynq.Client, base, queue, prefix string, n int, headers map[string]string) {
	t.Helper()
	for i := 0; i < n; i++ {
		task, err := jobs.NewHTTPRequestTask(jobs.HTTPRequestPayload{URL: fmt.Sprintf("%s/%s/%d", base, prefix, i), Headers: headers})
		if err != nil {
			t.Fatal(err)
		}
		opts := []asynq.Option{asynq.Queue(queue)}
		if i%2 == 0 {
			opts = append(opts, asynq.MaxRetry(0))
		}
		if _, err := client.Enqueue(task, opts...); err != nil {
			t.Fatal(err)
		}
	}
}
