package jobs

import (
	"net/http"
	"strconv"
	"strings"
	"time"
)

// Allowance is what an upstream states of its rate limit in an answer's
// headers. For "RateLimit-Policy: 100;w=60" and "RateLimit: r=3": Limit
// 100, Window a minute, Remaining 3.
type Allowance struct {
	Limit     int           // requests allowed per Window; 0: not stated
	Window    time.Duration // 0: not stated (an adaptive quota assumes its period)
	Remaining int           // requests left in the current window; -1: not stated
}

// Bounds on what UpstreamAllowance reads: a header longer than
// maxAllowanceHeader, or a number past these, is not used.
const (
	maxAllowanceHeader = 1024
	maxAllowanceItems  = 16
	maxStatedLimit     = 1_000_000_000
	maxStatedWindow    = 24 * time.Hour
)

// UpstreamAllowance reads the limit an answer's headers state, or returns
// nil if they state none it can use: RateLimit-Policy (the quota and
// window of draft-ietf-httpapi-ratelimit-headers, "name";q=100;w=60, or
// the earlier drafts' 100;w=60, the lowest rate of a list), RateLimit
// (r=, or remaining=) and RateLimit-Limit / RateLimit-Remaining of the
// earlier drafts, and the common X-RateLimit-Limit / X-RateLimit-Remaining
// (whose window is not stated). Every value is bounded; one out of bounds
// or malformed is left out.
func UpstreamAllowance(h http.Header) *Allowance {
	a := Allowance{Remaining: -1}
	if q, w, ok := parsePolicy(h.Get("RateLimit-Policy")); ok {
		a.Limit, a.Window = q, w
	}
	for _, name := range []string{"RateLimit-Limit", "X-RateLimit-Limit"} {
		if a.Limit == 0 {
			a.Limit = boundedInt(h.Get(name))
		}
	}
	a.Remaining = remainingOf(h.Get("RateLimit"))
	for _, name := range []string{"RateLimit-Remaining", "X-RateLimit-Remaining"} {
		if a.Remaining < 0 {
			if v := strings.TrimSpace(h.Get(name)); v != "" && len(v) <= 10 {
				if n, err := strconv.Atoi(v); err == nil && n >= 0 {
					a.Remaining = n
				}
			}
		}
	}
	if a.Limit == 0 {
		return nil
	}
	return &a
}

// boundedInt is v as a count between 1 and maxStatedLimit, or 0.
func boundedInt(v string) int {
	v = strings.TrimSpace(v)
	if v == "" || len(v) > 10 {
		return 0
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < 1 || n > maxStatedLimit {
		return 0
	}
	return n
}

// parsePolicy reads a RateLimit-Policy field: a list of policies, each a
// name or a number followed by ;key=value parameters (q: quota, w: window
// in seconds). It returns the policy with the lowest rate.
func parsePolicy(v string) (int, time.Duration, bool) {
	if v == "" || len(v) > maxAllowanceHeader {
		return 0, 0, false
	}
	best, bestWindow, found := 0, time.Duration(0), false
	for i, item := range strings.Split(v, ",") {
		if i >= maxAllowanceItems {
			break
		}
		parts := strings.Split(item, ";")
		q := boundedInt(parts[0]) // the earlier drafts: the quota first
		window := time.Duration(0)
		for _, p := range parts[1:] {
			k, val, _ := strings.Cut(strings.TrimSpace(p), "=")
			switch strings.ToLower(k) {
			case "q":
				q = boundedInt(val)
			case "w":
				if s := boundedInt(val); s > 0 && time.Duration(s)*time.Second <= maxStatedWindow {
					window = time.Duration(s) * time.Second
				}
			}
		}
		if q == 0 {
			continue
		}
		// The lowest rate: q/window compared as q·bestWindow < best·window,
		// an unstated window as a second.
		w, bw := max(window, time.Second), max(bestWindow, time.Second)
		if !found || float64(q)*float64(bw) < float64(best)*float64(w) {
			best, bestWindow, found = q, window, true
		}
	}
	return best, bestWindow, found
}

// remainingOf reads the remaining allowance of a RateLimit field: r=N
// (the current draft's "name";r=N;t=M) or remaining=N (an earlier one's),
// the lowest of a list; -1 if none.
func remainingOf(v string) int {
	if v == "" || len(v) > maxAllowanceHeader {
		return -1
	}
	lowest := -1
	for i, part := range strings.FieldsFunc(v, func(r rune) bool { return r == ',' || r == ';' }) {
		if i >= 4*maxAllowanceItems {
			break
		}
		k, val, ok := strings.Cut(strings.TrimSpace(part), "=")
		if !ok || (strings.ToLower(k) != "r" && strings.ToLower(k) != "remaining") {
			continue
		}
		val = strings.TrimSpace(val)
		if len(val) > 10 {
			continue
		}
		if n, err := strconv.Atoi(val); err == nil && n >= 0 && (lowest < 0 || n < lowest) {
			lowest = n
		}
	}
	return lowest
}
