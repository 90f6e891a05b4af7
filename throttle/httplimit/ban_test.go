package httplimit

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/sluicehq/sluice/internal/redistest"
	"github.com/sluicehq/sluice/throttle"
)

// TestBanGrows: an API key refused After times within Within is banned for
// For; while banned it is refused with the ban's remaining time, touching no
// limit, and another key from the same address is not held back; each
// further ban lasts twice as long as the one before, up to Max.
func TestBanGrows(t *testing.T) {
	f := newFixture(t, redistest.Client(t), Config{
		Limits: []Limit{
			{Name: "overall", Key: KeyGlobal, Spec: spec(throttle.SlidingLog, 100, time.Hour)},
			{Name: "per-client", Key: KeyClient, Spec: spec(throttle.SlidingLog, 1, 10*time.Second)},
		},
		Ban: Ban{After: 3, Within: time.Minute, For: 5 * time.Minute, Max: 20 * time.Minute},
	})
	alice := request{key: "alice"}
	for round, ban := range []time.Duration{5 * time.Minute, 10 * time.Minute, 20 * time.Minute, 20 * time.Minute} {
		t.Logf("round %d at +%v: a ban of %v", round+1, f.clock.Now().Sub(t0), ban)
		f.mustDo(t, alice, http.StatusOK, 0)
		f.mustDo(t, alice, http.StatusTooManyRequests, 10)
		f.mustDo(t, alice, http.StatusTooManyRequests, 10)
		f.mustDo(t, alice, http.StatusTooManyRequests, int(ban/time.Second)) // the third refusal bans

		f.clock.Add(ban / 2)
		overall, perClient := f.remaining(t, "overall", "global"), f.remaining(t, "per-client", clientID("alice"))
		for range 3 {
			w := f.mustDo(t, alice, http.StatusTooManyRequests, int(ban/2/time.Second))
			if got, want := w.Header().Get("RateLimit"), fmt.Sprintf(`"ban";r=0;t=%d`, ban/2/time.Second); got != want {
				t.Fatalf("RateLimit %q, want %q", got, want)
			}
			var problem struct{ Type string }
			if err := json.Unmarshal(w.Body.Bytes(), &problem); err != nil || problem.Type != problemAbuse {
				t.Fatalf("body %s, want the abnormal-usage-detected problem", w.Body)
			}
		}
		if o, p := f.remaining(t, "overall", "global"), f.remaining(t, "per-client", clientID("alice")); o != overall || p != perClient {
			t.Fatalf("banned requests touched the limits: overall %d → %d, per-client %d → %d", overall, o, perClient, p)
		}
		f.mustDo(t, request{key: "bob"}, http.StatusOK, 0) // the same address, another key

		f.clock.Add(ban/2 - time.Second)
		f.mustDo(t, alice, http.StatusTooManyRequests, 1)
		f.clock.Add(time.Second) // the ban ends: the next round begins with a request that passes
	}
	if got := f.metric(f.lim.metrics.bans.WithLabelValues("client")); got != 4 {
		t.Errorf("sluice_http_bans_total{key=client} = %d, want 4", got)
	}
	if got := f.metric(f.lim.metrics.decisions.WithLabelValues("ban", "refused")); got != 4*4 {
		t.Errorf("sluice_http_decisions_total{limit=ban,result=refused} = %d, want 16", got)
	}
}

// TestBanIdentity: a ban is on what the refusing limit counts. Refusals by
// an ip limit ban the address, whatever API key it sends next; refusals by
// limits that are not one client's doing ban no one.
func TestBanIdentity(t *testing.T) {
	tests := []struct {
		desc    string
		limit   Limit
		ban     string // the label of the ban, "" for none
		mallory int    // the status of a request with an API key from the same address
	}{
		{"per-ip refusals ban the address", Limit{Name: "per-ip", Key: KeyIP, Spec: spec(throttle.SlidingLog, 1, 10*time.Second)}, "ip", http.StatusTooManyRequests},
		{"refusals of the shared anonymous key ban no one", Limit{Name: "per-client", Key: KeyClient, Spec: spec(throttle.SlidingLog, 1, 10*time.Second)}, "", http.StatusOK},
		{"global refusals ban no one", Limit{Name: "overall", Key: KeyGlobal, Spec: spec(throttle.SlidingLog, 1, 10*time.Second)}, "", http.StatusTooManyRequests},
	}
	rdb := redistest.Client(t)
	for _, tt := range tests {
		t.Run(tt.desc, func(t *testing.T) {
			f := newFixture(t, rdb, Config{Limits: []Limit{tt.limit}, Ban: Ban{After: 2, Within: time.Minute, For: time.Minute}})
			anonymous := request{peer: "192.0.2.7:1"}
			f.mustDo(t, anonymous, http.StatusOK, 0)
			f.mustDo(t, anonymous, http.StatusTooManyRequests, 10)
			retry := 10
			if tt.ban != "" {
				retry = 60
			}
			f.mustDo(t, anonymous, http.StatusTooManyRequests, retry)
			f.mustDo(t, anonymous, http.StatusTooManyRequests, retry)
			f.mustDo(t, request{key: "mallory", peer: "192.0.2.7:1"}, tt.mallory, 0)
			for _, label := range []string{"ip", "client"} {
				want := 0
				if label == tt.ban {
					want = 1
				}
				if got := f.metric(f.lim.metrics.bans.WithLabelValues(label)); got != want {
					t.Errorf("sluice_http_bans_total{key=%s} = %d, want %d", label, got, want)
				}
			}
			if tt.ban == "ip" {
				f.mustDo(t, request{peer: "192.0.2.8:1"}, http.StatusOK, 0)
			}
		})
	}
}

// TestRefusedCountsTowardBans (9.12): refusals the service makes itself
// (a bad API key) count toward a ban on the address, as refusals by an ip
// limit do; Bans then answers the banned address before the handler runs,
// so a banned client costs no body read, and Limits alone reserves the
// limits without asking about bans again.
func TestRefusedCountsTowardBans(t *testing.T) {
	f := newFixture(t, redistest.Client(t), Config{
		Limits: []Limit{{Name: "overall", Key: KeyGlobal, Spec: spec(throttle.SlidingLog, 100, time.Hour)}},
		Ban:    Ban{After: 3, Within: time.Minute, For: time.Minute},
	})
	var reached int
	h := f.lim.Bans(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		reached++
		if _, ok := ClientFrom(r.Context()); !ok {
			t.Error("the handler behind Bans sees no Client")
		}
		if d := f.lim.Refused(r); reached < 3 && d != 0 || reached == 3 && d != time.Minute {
			t.Errorf("refusal %d: ban of %v, want one of 1m at the third only", reached, d)
		}
		w.WriteHeader(http.StatusUnauthorized)
	}))
	do := func(peer string) int {
		req := httptest.NewRequest(http.MethodPost, "/", nil)
		req.RemoteAddr = peer
		w := httptest.NewRecorder()
		h.ServeHTTP(w, req)
		return w.Code
	}
	for i := range 3 {
		if code := do("192.0.2.9:1"); code != http.StatusUnauthorized {
			t.Fatalf("request %d: %d, want 401 from the handler", i+1, code)
		}
	}
	if code := do("192.0.2.9:2"); code != http.StatusTooManyRequests || reached != 3 {
		t.Fatalf("after 3 refusals: %d with the handler reached %d times, want 429 before the handler", code, reached)
	}
	if code := do("192.0.2.10:1"); code != http.StatusUnauthorized {
		t.Fatalf("another address: %d, want 401 from the handler", code)
	}
	if got := f.metric(f.lim.metrics.bans.WithLabelValues("ip")); got != 1 {
		t.Errorf("sluice_http_bans_total{key=ip} = %d, want 1", got)
	}
	limits := f.lim.Limits(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}))
	req := httptest.NewRequest(http.MethodPost, "/", nil)
	req.RemoteAddr = "192.0.2.9:3"
	w := httptest.NewRecorder()
	limits.ServeHTTP(w, req)
	if w.Code != http.StatusOK || f.remaining(t, "overall", "global") != 99 {
		t.Errorf("Limits alone: %d with %d left of overall, want 200 and the request counted (99 left)", w.Code, f.remaining(t, "overall", "global"))
	}
}
