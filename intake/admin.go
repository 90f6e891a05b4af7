package intake

import (
	"crypto/sha256"
	"crypto/subtle"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/sluicehq/sluice/internal/strictjson"
	"github.com/sluicehq/sluice/jobs"
	"github.com/sluicehq/sluice/producer"
)

// The admin API changes and shows the fleet's limits live, as enqueue
// limits does (jobs.SetLimit and the rest):
//
//	GET    /v1/limits                  every gate, its limit in the file and in force (?keys=true: each key value's override)
//	PUT    /v1/limits/{gate}           {"limit": 25, "period": "1s", "burst": 5, "algorithm": "...", "key": "...", "for": "5m", "reason": "...", "by": "..."}
//	DELETE /v1/limits/{gate}?reason=…  [&key=…&by=…]: the file's limit again
//	GET    /v1/limits/history          [?gate=…&limit=N], newest first
//	GET    /v1/tasks/{queue}/{id}      when the task will start (as enqueue eta --json)
//
// Only with gateway.admin_token_hash set, and only for requests with
// "Authorization: Bearer <token>": a wrong or missing token is 401,
// changes nothing and counts toward the address's ban. Without an admin
// token the routes answer 404, as if they did not exist.

// maxAdminBody bounds a PUT's body: a limit's few fields and a reason.
const maxAdminBody = 4 << 10

// adminRoutes adds the admin API to in's mux.
func (in *Intake) adminRoutes() {
	handle := func(pattern string, h http.HandlerFunc) {
		in.mux.Handle(pattern, in.limiter.Bans(in.admin(h)))
	}
	handle("GET /v1/limits", in.listLimits)
	handle("PUT /v1/limits/{gate}", in.setLimit)
	handle("DELETE /v1/limits/{gate}", in.resetLimit)
	handle("GET /v1/limits/history", in.limitHistory)
	handle("GET /v1/tasks/{queue}/{id}", in.taskETA)
}

// admin lets in a request with the admin token: 404 if none is
// configured, 401 (counted toward a ban) for a wrong or missing one.
func (in *Intake) admin(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		rules := in.rules.Load()
		if !rules.adminOn {
			http.NotFound(w, r)
			return
		}
		token, bearer := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
		sum := sha256.Sum256([]byte(token))
		if !bearer || len(token) > 1024 || subtle.ConstantTimeCompare(sum[:], rules.admin[:]) != 1 {
			in.limiter.Refused(r)
			w.Header().Set("WWW-Authenticate", `Bearer realm="sluice admin"`)
			w.Header().Set("Connection", "close")
			in.answerJSON(w, http.StatusUnauthorized, map[string]string{"error": "the admin API needs the admin token: Authorization: Bearer <token>"})
			return
		}
		next.ServeHTTP(w, r)
	})
}

func (in *Intake) listLimits(w http.ResponseWriter, r *http.Request) {
	keys, _ := strconv.ParseBool(r.URL.Query().Get("keys"))
	gates, err := jobs.ListLimits(r.Context(), in.rdb, in.rules.Load().jobs, keys)
	if err != nil {
		in.redisFailed(w, err)
		return
	}
	in.answerJSON(w, http.StatusOK, map[string]any{"gates": gates})
}

func (in *Intake) setLimit(w http.ResponseWriter, r *http.Request) {
	gate, err := jobs.ParseGateName(r.PathValue("gate"))
	if err != nil {
		in.refuse(w, "gate", err)
		return
	}
	raw, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxAdminBody))
	if err != nil {
		in.refuse(w, "", fmt.Errorf("reading the body: %w (at most %d bytes)", err, maxAdminBody))
		return
	}
	var body jobs.LimitChangeJSON
	if err := strictjson.Decode(raw, &body); err != nil {
		var bad *strictjson.Error
		field := ""
		if errors.As(err, &bad) {
			field = bad.Field
		}
		in.refuse(w, field, err)
		return
	}
	ch, err := body.Change(gate)
	if in.changeFailed(w, err) {
		return
	}
	if ch.By == "" {
		ch.By = "admin API from " + in.limiter.Client(r).IP.String()
	}
	set, err := jobs.SetLimit(r.Context(), in.rdb, in.rules.Load().jobs, ch)
	if in.changeFailed(w, err) {
		return
	}
	in.answerJSON(w, http.StatusOK, map[string]any{"set": set})
}

func (in *Intake) resetLimit(w http.ResponseWriter, r *http.Request) {
	gate, err := jobs.ParseGateName(r.PathValue("gate"))
	if err != nil {
		in.refuse(w, "gate", err)
		return
	}
	q := r.URL.Query()
	by := q.Get("by")
	if by == "" {
		by = "admin API from " + in.limiter.Client(r).IP.String()
	}
	had, err := jobs.ResetLimit(r.Context(), in.rdb, in.rules.Load().jobs, gate, q.Get("key"), by, q.Get("reason"))
	if in.changeFailed(w, err) {
		return
	}
	in.answerJSON(w, http.StatusOK, map[string]any{"reset": had})
}

func (in *Intake) limitHistory(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	var gate jobs.GateName
	if g := q.Get("gate"); g != "" {
		var err error
		if gate, err = jobs.ParseGateName(g); err != nil {
			in.refuse(w, "gate", err)
			return
		}
	}
	n := 20
	if l := q.Get("limit"); l != "" {
		var err error
		if n, err = strconv.Atoi(l); err != nil || n < 1 || n > 10_000 {
			in.refuse(w, "limit", fmt.Errorf("must be a number from 1 to 10000, got %q", l))
			return
		}
	}
	events, err := jobs.LimitHistory(r.Context(), in.rdb, gate, n)
	if err != nil {
		in.redisFailed(w, err)
		return
	}
	in.answerJSON(w, http.StatusOK, map[string]any{"events": events})
}

func (in *Intake) taskETA(w http.ResponseWriter, r *http.Request) {
	queue, id := r.PathValue("queue"), r.PathValue("id")
	if err := producer.CheckQueue(queue); err != nil {
		in.refuse(w, "queue", err)
		return
	}
	if len(id) > producer.MaxTaskID {
		in.refuse(w, "id", fmt.Errorf("a task id is at most %d bytes, got %d", producer.MaxTaskID, len(id)))
		return
	}
	cfg, err := jobs.InForce(r.Context(), in.rdb, in.rules.Load().jobs, time.Now())
	if err != nil {
		in.redisFailed(w, err)
		return
	}
	e, err := jobs.ETA(r.Context(), in.rdb, in.rdb, cfg, queue, id)
	var missing *jobs.TaskNotFoundError
	switch {
	case errors.As(err, &missing):
		in.answerJSON(w, http.StatusNotFound, map[string]string{"error": err.Error()})
	case err != nil:
		in.redisFailed(w, err)
	default:
		in.answerJSON(w, http.StatusOK, map[string]any{"task": e, "wait_seconds": e.Wait().Seconds()})
	}
}

// changeFailed answers a change's error, if any: 400 naming the field of
// a refused change, 503 for Redis's failure.
func (in *Intake) changeFailed(w http.ResponseWriter, err error) bool {
	var refused *jobs.LimitChangeError
	switch {
	case err == nil:
		return false
	case errors.As(err, &refused):
		in.refuse(w, refused.Field, errors.New(refused.Problem))
	default:
		in.redisFailed(w, err)
	}
	return true
}

// refuse answers 400 with what is wrong, and the field at fault if known.
func (in *Intake) refuse(w http.ResponseWriter, field string, err error) {
	body := map[string]any{"error": err.Error()}
	if field != "" {
		body["field"] = field
	}
	in.answerJSON(w, http.StatusBadRequest, body)
}

func (in *Intake) redisFailed(w http.ResponseWriter, err error) {
	in.log.Error("admin API: Redis failed", "err", err)
	w.Header().Set("Retry-After", "1")
	in.answerJSON(w, http.StatusServiceUnavailable, map[string]string{"error": "Redis failed; try again"})
}
