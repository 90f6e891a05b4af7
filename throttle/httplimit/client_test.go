package httplimit

import (
	"fmt"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/internal/redistest"
	"github.com/sluicehq/sluice/throttle"
)

// TestClientIP: X-Forwarded-For is believed only from trusted proxies, read
// from the right, skipping trusted proxies; the first other address is the
// client, and a malformed entry leaves the last trusted hop as the client.
func TestClientIP(t *testing.T) {
	trusted := []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8"), netip.MustParsePrefix("2001:db8:ffff::/48")}
	tests := []struct {
		desc string
		peer string
		xff  []string
		want string // "" for the zero Addr
	}{
		{"no proxy", "203.0.113.7:4711", nil, "203.0.113.7"},
		{"an untrusted peer's header is ignored", "203.0.113.7:4711", []string{"198.51.100.1"}, "203.0.113.7"},
		{"a trusted peer is believed", "10.0.0.1:80", []string{"203.0.113.7"}, "203.0.113.7"},
		{"a trusted peer without the header is the client", "10.0.0.1:80", nil, "10.0.0.1"},
		{"a chain of trusted proxies is skipped", "10.0.0.1:80", []string{"203.0.113.7, 10.0.0.2, 10.0.0.3"}, "203.0.113.7"},
		{"what the client wrote itself is ignored", "10.0.0.1:80", []string{"198.51.100.1, 10.9.9.9, 203.0.113.7, 10.0.0.2"}, "203.0.113.7"},
		{"several field lines are one list", "10.0.0.1:80", []string{"198.51.100.1, 203.0.113.7", "10.0.0.2"}, "203.0.113.7"},
		{"malformed after a trusted hop: that hop", "10.0.0.1:80", []string{"203.0.113.7, unknown, 10.0.0.2"}, "10.0.0.2"},
		{"malformed first: the peer", "10.0.0.1:80", []string{"203.0.113.7, 203.0.113.8:abc"}, "10.0.0.1"},
		{"an empty entry is malformed", "10.0.0.1:80", []string{"203.0.113.7,,10.0.0.2"}, "10.0.0.2"},
		{"a trailing comma is malformed", "10.0.0.1:80", []string{"203.0.113.7,"}, "10.0.0.1"},
		{"only trusted proxies: the leftmost", "10.0.0.1:80", []string{"10.0.0.5, 10.0.0.2"}, "10.0.0.5"},
		{"entries with ports", "10.0.0.1:80", []string{"[2001:db8::1]:4711, 10.0.0.2:8080"}, "2001:db8::1"},
		{"a trusted IPv6 peer", "[2001:db8:ffff::1]:80", []string{"203.0.113.7"}, "203.0.113.7"},
		{"an IPv4-mapped peer is IPv4", "[::ffff:10.0.0.1]:80", []string{"203.0.113.7"}, "203.0.113.7"},
		{"a peer that is no address", "@", []string{"203.0.113.7"}, ""},
	}
	lim := mustLimiter(t, Config{TrustedProxies: trusted})
	for _, tt := range tests {
		t.Run(tt.desc, func(t *testing.T) {
			r := httptest.NewRequest(http.MethodGet, "/", nil)
			r.RemoteAddr = tt.peer
			for _, line := range tt.xff {
				r.Header.Add("X-Forwarded-For", line)
			}
			var want netip.Addr
			if tt.want != "" {
				want = netip.MustParseAddr(tt.want)
			}
			if got := lim.Client(r).IP; got != want {
				t.Errorf("IP %v, want %v", got, want)
			}
		})
	}
}

// TestClientKeys: API keys are hashed, anonymous requests share one key,
// and IPv6 clients are counted per network.
func TestClientKeys(t *testing.T) {
	lim := mustLimiter(t, Config{})
	r := httptest.NewRequest(http.MethodGet, "/", nil)
	if c := lim.Client(r); c.ID != Anonymous {
		t.Errorf("no API key: ID %q, want %q", c.ID, Anonymous)
	}
	r.Header.Set("X-API-Key", "s3cr3t-key")
	c := lim.Client(r)
	if !strings.HasPrefix(c.ID, "key:") || len(c.ID) != 36 || strings.Contains(c.ID, "s3cr3t") {
		t.Errorf("ID %q, want key: and 32 hex digits", c.ID)
	}
	tests := []struct {
		desc   string
		bits   int
		a, b   string
		shared bool
	}{
		{"IPv6 in one /64 is one client", 0, "2001:db8:1:2::1", "2001:db8:1:2:ffff::9", true},
		{"IPv6 in two /64s are two", 0, "2001:db8:1:2::1", "2001:db8:1:3::1", false},
		{"with IPv6Prefix 128 every address is its own", 128, "2001:db8:1:2::1", "2001:db8:1:2::2", false},
		{"IPv4 addresses are each their own", 0, "192.0.2.1", "192.0.2.2", false},
	}
	for _, tt := range tests {
		t.Run(tt.desc, func(t *testing.T) {
			lim := mustLimiter(t, Config{IPv6Prefix: tt.bits})
			a, b := lim.ipKey(netip.MustParseAddr(tt.a)), lim.ipKey(netip.MustParseAddr(tt.b))
			if (a == b) != tt.shared {
				t.Errorf("keys %q and %q, want shared %v", a, b, tt.shared)
			}
		})
	}
}

// mustLimiter is a Limiter whose Redis is never called.
func mustLimiter(t *testing.T, cfg Config) *Limiter {
	t.Helper()
	lim, err := New(redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"}), cfg)
	if err != nil {
		t.Fatal(err)
	}
	return lim
}

// TestForwardedForLimits: 1,000 requests, each with a random X-Forwarded-For,
// are one client to the per-ip limit when the peer is not a trusted proxy,
// and 1,000 clients when it is.
func TestForwardedForLimits(t *testing.T) {
	tests := []struct {
		desc    string
		trusted []netip.Prefix
		served  int
	}{
		{"untrusted peer: one client", nil, 100},
		{"trusted peer: every address its own client", []netip.Prefix{netip.MustParsePrefix("192.0.2.0/24")}, 1000},
	}
	rdb := redistest.Client(t)
	for _, tt := range tests {
		t.Run(tt.desc, func(t *testing.T) {
			f := newFixture(t, rdb, Config{
				Limits:         []Limit{{Name: "per-ip", Key: KeyIP, Spec: spec(throttle.SlidingCounter, 100, time.Minute)}},
				TrustedProxies: tt.trusted,
			})
			for _, n := range rand.Perm(1 << 16)[:1000] {
				f.do(request{xff: []string{fmt.Sprintf("198.18.%d.%d", n>>8, n&0xff)}})
			}
			if f.served != tt.served {
				t.Errorf("%d of 1000 served, want %d", f.served, tt.served)
			}
		})
	}
}

// TestNewRejects: a bad Config is refused with an error naming the field.
func TestNewRejects(t *testing.T) {
	ok := throttle.Spec{Algorithm: throttle.SlidingLog, Limit: 1, Period: time.Second}
	tests := []struct {
		desc string
		cfg  Config
		want string
	}{
		{"a name that is not a token", Config{Limits: []Limit{{Name: `a"b`, Key: KeyGlobal, Spec: ok}}}, `Limits[0].Name`},
		{"a name taken twice", Config{Limits: []Limit{{Name: "a", Key: KeyGlobal, Spec: ok}, {Name: "a", Key: KeyIP, Spec: ok}}}, `Limits[1].Name`},
		{"the name ban", Config{Limits: []Limit{{Name: "ban", Key: KeyGlobal, Spec: ok}}}, `Limits[0].Name`},
		{"an unknown key", Config{Limits: []Limit{{Name: "a", Key: "user", Spec: ok}}}, `Limits[0] (a): Key must be`},
		{"a type key without a KeyFunc", Config{Limits: []Limit{{Name: "a", Key: KeyType, Spec: ok}}}, `WithKeyFunc`},
		{"an unknown policy", Config{Limits: []Limit{{Name: "a", Key: KeyIP, Spec: ok, OnRedisError: "retry"}}}, `Limits[0] (a): OnRedisError must be`},
		{"a bad spec", Config{Limits: []Limit{{Name: "a", Key: KeyIP, Spec: throttle.Spec{Algorithm: throttle.SlidingLog, Period: time.Second}}}}, `Limits[0] (a): throttle: invalid spec: Spec.Limit`},
		{"a ban without After", Config{Ban: Ban{For: time.Minute}}, `Ban.After`},
		{"a ban whose Max is below For", Config{Ban: Ban{After: 1, Within: time.Minute, For: time.Hour, Max: time.Minute}}, `Ban.Max`},
		{"a ban without Within", Config{Ban: Ban{After: 1, For: time.Minute}}, `Ban.Within`},
		{"an IPv6Prefix too long", Config{IPv6Prefix: 129}, `IPv6Prefix`},
		{"a prefix with a brace", Config{Prefix: "a{", Limits: []Limit{{Name: "a", Key: KeyIP, Spec: ok}}}, `WithPrefix`},
	}
	for _, tt := range tests {
		t.Run(tt.desc, func(t *testing.T) {
			_, err := New(redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"}), tt.cfg)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("New: %v, want an error about %s", err, tt.want)
			}
		})
	}
}
