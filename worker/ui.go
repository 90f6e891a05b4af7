package worker

import (
	"crypto/sha256"
	"crypto/subtle"
	"errors"
	"net/http"
	"sync"
	"sync/atomic"

	"github.com/hibiken/asynq"
	"github.com/hibiken/asynqmon"
	"golang.org/x/crypto/bcrypt"

	"github.com/sluicehq/sluice/jobs"
)

// webUI returns asynqmon at /ui/, and the limits page at /ui/limits, as ui allows: read-only unless ui.Writes,
// and behind HTTP basic auth when ui has a password hash (config.Load
// checked that writes come with one). close closes asynqmon's connections
// to Redis (its own client and inspector).
func webUI(ui jobs.WebUIConfig, redisOpt asynq.RedisConnOpt, limits *limitsPage) (h http.Handler, close func() error) {
	mon := asynqmon.New(asynqmon.Options{RootPath: "/ui", RedisConnOpt: redisOpt, ReadOnly: !ui.Writes})
	mux := http.NewServeMux()
	mux.Handle("/ui/", mon)
	limits.routes(mux)
	h = mux
	if !ui.Writes {
		// asynqmon's ReadOnly refuses methods other than GET on the API
		// routes it knows; this refuses them on every path, whatever a
		// later asynqmon routes, before asynqmon sees the request.
		h = readOnly(h)
	}
	if ui.PasswordHash != "" {
		h = (&basicAuth{user: ui.User, hash: []byte(ui.PasswordHash)}).wrap(h)
	}
	return h, func() error { return errors.Join(mon.Close(), limits.close()) }
}

// readOnly answers 405 to any method but GET and HEAD.
func readOnly(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodGet && r.Method != http.MethodHead {
			w.Header().Set("Allow", "GET, HEAD")
			http.Error(w, "the web UI is read-only: set worker.ui.writes (with a user and password hash) to change tasks or queues", http.StatusMethodNotAllowed)
			return
		}
		next.ServeHTTP(w, r)
	})
}

// basicAuth lets in requests whose basic auth credentials match user and
// the bcrypt hash. bcrypt is slow on purpose, and the UI makes a request
// every few seconds, so the credentials that last passed are remembered as
// their SHA-256 and later ones compared with it in constant time; other
// credentials go to bcrypt one at a time, so a flood of guesses holds one
// core at most.
type basicAuth struct {
	user     string
	hash     []byte
	mu       sync.Mutex
	verified atomic.Pointer[[sha256.Size]byte]
}

func (a *basicAuth) wrap(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		user, password, ok := r.BasicAuth()
		if !ok || !a.check(user, password) {
			w.Header().Set("WWW-Authenticate", `Basic realm="sluice worker", charset="UTF-8"`)
			http.Error(w, "log in with worker.ui.user and its password", http.StatusUnauthorized)
			return
		}
		next.ServeHTTP(w, r)
	})
}

func (a *basicAuth) check(user, password string) bool {
	sum := sha256.Sum256([]byte(user + "\x00" + password))
	if v := a.verified.Load(); v != nil && subtle.ConstantTimeCompare(sum[:], v[:]) == 1 {
		return true
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	// Both compared every time, so the time taken does not tell which failed.
	passwordOK := bcrypt.CompareHashAndPassword(a.hash, []byte(password)) == nil
	userOK := subtle.ConstantTimeCompare([]byte(user), []byte(a.user)) == 1
	if !passwordOK || !userOK {
		return false
	}
	a.verified.Store(&sum)
	return true
}
