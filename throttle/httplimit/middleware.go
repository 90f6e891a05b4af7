package httplimit

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"time"

	"github.com/sluicehq/sluice/throttle"
)

// Middleware returns next behind the bans and the limits: a request
// reaches next only if no ban holds on it and every limit admits it. Its
// Client is in the context next sees (ClientFrom). See the package doc for
// the answers. It is shorthand for Bans(Limits(next)).
func (l *Limiter) Middleware(next http.Handler) http.Handler {
	return l.Bans(l.Limits(next))
}

// Bans returns next behind the bans alone: a banned request is answered
// 429 without reaching next, and costs one Redis call per identity. Its
// Client is in the context next sees. A service puts its cheap checks (an
// API key) between Bans and Limits, and reads the request body only after
// them, so that a banned or unknown client costs no body read.
func (l *Limiter) Bans(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		c := l.Client(r)
		r = r.WithContext(context.WithValue(r.Context(), clientContextKey{}, c))
		if a, banned := l.banned(r.Context(), l.identities(c)); banned {
			// Closing the connection spares the server reading a body it
			// does not want (net/http reads up to 256 KiB of an unread body
			// before it answers on a connection it keeps).
			w.Header().Set("Connection", "close")
			a.setRateLimit(w.Header())
			a.refuse(w)
			return
		}
		next.ServeHTTP(w, r)
	})
}

// Limits returns next behind the limits alone: a request reaches next only
// if every limit admits it. Refusals count toward bans, but bans are not
// checked: put Bans in front (or use Middleware).
func (l *Limiter) Limits(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		c, ok := ClientFrom(r.Context())
		if !ok {
			c = l.Client(r)
			r = r.WithContext(context.WithValue(r.Context(), clientContextKey{}, c))
		}
		a := l.decide(r, c)
		a.setRateLimit(w.Header())
		if a.status == 0 {
			next.ServeHTTP(w, r)
			return
		}
		a.refuse(w)
	})
}

// Refused counts a refusal that the service made itself, such as a
// missing or unknown API key, toward a ban on r's client address, the way
// a refusal by an ip limit counts: the address, because a key that fails
// is the client's own choice and a new one costs nothing. It returns the
// length of the ban this refusal began, 0 if none (always 0 without
// Config.Ban). The answer to r is the caller's to write.
func (l *Limiter) Refused(r *http.Request) time.Duration {
	if l.ban == nil {
		return 0
	}
	c, ok := ClientFrom(r.Context())
	if !ok {
		c = l.Client(r)
	}
	return l.countRefusal(r.Context(), KeyIP, l.identities(c)[KeyIP])
}

// The problem types of draft-ietf-httpapi-ratelimit-headers.
const (
	problemQuota    = "https://iana.org/assignments/http-problem-types#quota-exceeded"
	problemAbuse    = "https://iana.org/assignments/http-problem-types#abnormal-usage-detected"
	problemCapacity = "https://iana.org/assignments/http-problem-types#temporary-reduced-capacity"
)

var problemTitles = map[string]string{
	problemQuota:    "Too many requests: a rate limit is exceeded",
	problemAbuse:    "Banned for a while after too many refused requests",
	problemCapacity: "Rate limits cannot be checked now",
}

// answer is the Middleware's verdict on one request.
type answer struct {
	status  int           // 0: pass the request on; else 429 or 503
	problem string        // the problem type of a refusal
	retry   time.Duration // the Retry-After of a refusal
	policy  string        // the limit (or "ban") that refused, or that the RateLimit fields name
	limit   *limit        // that limit, for RateLimit-Policy; nil for a ban
	left    int           // r: requests left
	window  time.Duration // t
}

// identities are the identities of c a ban can be on, by the kind of
// limit whose refusals ban them (see the package doc).
func (l *Limiter) identities(c Client) map[KeyKind]string {
	ids := map[KeyKind]string{KeyIP: "ip:" + l.ipKey(c.IP)}
	if c.ID != Anonymous {
		ids[KeyClient] = c.ID
	}
	return ids
}

// decide checks r's limits, counting it on all of them or on none: one
// throttle.Book (one round trip on a single Redis; see the package doc for
// Redis Cluster).
func (l *Limiter) decide(r *http.Request, c Client) answer {
	if len(l.limits) == 0 {
		return answer{}
	}
	ctx := r.Context()
	ipKey := l.ipKey(c.IP)
	claims := make([]throttle.Claim, len(l.limits))
	for i, lim := range l.limits {
		claims[i] = throttle.Claim{Limiter: lim.lim, Key: l.key(lim, r, c, ipKey), N: 1}
	}
	if l.pools != nil {
		if ok, left := l.pools.take(ctx, claims); ok {
			return l.allowed(left, nil)
		}
	}
	b, err := throttle.Book(ctx, claims, time.Time{}, 0)
	if err != nil {
		for _, lim := range l.limits {
			if lim.OnRedisError == OnRedisErrorDeny {
				l.redisError(lim.Name, err)
				l.metrics.fallbacks.WithLabelValues(lim.Name, OnRedisErrorDeny).Inc()
			}
		}
		return answer{status: http.StatusServiceUnavailable, problem: problemCapacity, retry: time.Second}
	}
	for i, turn := range b.Turns {
		if turn.Fallback != "" {
			l.redisError(l.limits[i].Name, errRedisFallback)
			l.metrics.fallbacks.WithLabelValues(l.limits[i].Name, turn.Fallback).Inc()
		}
	}
	if !b.OK {
		// The limit that refuses the longest names the refusal.
		refused := 0
		for i, turn := range b.Turns {
			if turn.Delay > b.Turns[refused].Delay {
				refused = i
			}
		}
		lim := l.limits[refused]
		l.metrics.decisions.WithLabelValues(lim.Name, "refused").Inc()
		a := answer{status: http.StatusTooManyRequests, problem: problemQuota, retry: b.Delay, policy: lim.Name, limit: lim}
		if id, ok := l.identities(c)[lim.Key]; ok && l.ban != nil {
			a.retry = max(a.retry, l.countRefusal(ctx, lim.Key, id))
		}
		a.window = a.retry
		return a
	}
	left := make([]int, len(b.Turns))
	fellBack := make([]bool, len(b.Turns))
	for i, turn := range b.Turns {
		left[i], fellBack[i] = turn.Remaining, turn.Fallback == OnRedisErrorAllow
	}
	return l.allowed(left, fellBack)
}

// allowed is the answer to a request every limit admitted: its RateLimit
// fields name the limit with the fewest requests left. A limit let through
// by its allow policy was counted nowhere: it says nothing of what is left.
func (l *Limiter) allowed(left []int, fellBack []bool) answer {
	var a answer
	for i, lim := range l.limits {
		l.metrics.decisions.WithLabelValues(lim.Name, "allowed").Inc()
		if i >= len(left) || (fellBack != nil && fellBack[i]) {
			continue
		}
		if a.limit == nil || left[i] < a.left {
			a = answer{policy: lim.Name, limit: lim, left: left[i], window: lim.window}
		}
	}
	return a
}

// errRedisFallback is what is logged when a limit's policy decided a
// request: throttle says which policy, not the Redis error itself.
var errRedisFallback = errors.New("redis failed; the limit's failure policy decided")

func (l *Limiter) key(lim *limit, r *http.Request, c Client, ipKey string) string {
	switch lim.Key {
	case KeyClient:
		return c.ID
	case KeyIP:
		return ipKey
	case KeyType:
		return l.keyFunc(r)
	}
	return "global"
}

// banned checks the bans on ids and returns the answer to a banned request.
func (l *Limiter) banned(ctx context.Context, ids map[KeyKind]string) (answer, bool) {
	if l.ban == nil {
		return answer{}, false
	}
	var longest time.Duration
	for _, id := range ids {
		d, err := l.ban.check(ctx, id)
		if err != nil && ctx.Err() == nil {
			l.redisError("ban", err)
		}
		longest = max(longest, d)
	}
	if longest == 0 {
		return answer{}, false
	}
	l.metrics.decisions.WithLabelValues("ban", "refused").Inc()
	return answer{status: http.StatusTooManyRequests, problem: problemAbuse, retry: longest, policy: "ban", window: longest}, true
}

// countRefusal counts a refusal toward a ban on id, of kind kind, and
// returns the length of the ban it caused; 0 for none.
func (l *Limiter) countRefusal(ctx context.Context, kind KeyKind, id string) time.Duration {
	d, err := l.ban.refused(context.WithoutCancel(ctx), id)
	if err != nil {
		l.redisError("ban", err)
	}
	if d > 0 {
		l.metrics.bans.WithLabelValues(string(kind)).Inc()
	}
	return d
}

// redisError counts err and logs it, at most once every 10 seconds per
// limit so that a Redis outage does not flood the log. The error never
// holds a key: throttle's errors name the script, not its keys.
func (l *Limiter) redisError(limit string, err error) {
	l.metrics.redisErrors.WithLabelValues(limit).Inc()
	if d, _ := l.logGates.AllowN(context.Background(), limit, 1); d.Allowed {
		l.log.Warn("httplimit: redis failed; further failures of this limit in the next 10s are only counted", "limit", limit, "err", err)
	}
}

// setRateLimit sets the RateLimit fields of the limit a answers for.
func (a answer) setRateLimit(h http.Header) {
	if a.policy == "" || a.status == http.StatusServiceUnavailable {
		return
	}
	if a.limit != nil {
		h.Set("RateLimit-Policy", fmt.Sprintf(`"%s";q=%d;w=%d`, a.policy, a.limit.quota, seconds(a.limit.window)))
	}
	h.Set("RateLimit", fmt.Sprintf(`"%s";r=%d;t=%d`, a.policy, a.left, seconds(a.window)))
}

// refuse writes a refusal: Retry-After and a problem+json body naming the
// limit.
func (a answer) refuse(w http.ResponseWriter) {
	h := w.Header()
	h.Set("Retry-After", strconv.FormatInt(max(1, seconds(a.retry)), 10))
	h.Set("Content-Type", "application/problem+json")
	w.WriteHeader(a.status)
	json.NewEncoder(w).Encode(struct {
		Type     string   `json:"type"`
		Title    string   `json:"title"`
		Status   int      `json:"status"`
		Violated []string `json:"violated-policies"`
	}{a.problem, problemTitles[a.problem], a.status, []string{a.policy}})
}

// seconds is d in whole seconds, rounded up.
func seconds(d time.Duration) int64 {
	return int64((d + time.Second - 1) / time.Second)
}
