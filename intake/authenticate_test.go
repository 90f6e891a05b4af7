package intake

import (
	"crypto/sha256"
	"encoding/hex"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/sluicehq/sluice/config"
	"github.com/sluicehq/sluice/internal/redistest"
)

// TestAuthenticateAfterReload (19.2): the start-time rule (no anonymous
// requests off loopback without gateway.allow_anonymous) holds for every
// config the intake takes in, one after another as live reloads do: a
// revoked key is refused at once, and an intake off loopback left with no
// clients refuses every request, with a key or without, 503 saying it has
// no clients configured, until a client or allow_anonymous comes back. On
// main, the config with no clients let every request in as anonymous.
func TestAuthenticateAfterReload(t *testing.T) {
	in, err := New(config.File{}, redistest.Client(t), nil, WithLogger(slog.New(slog.DiscardHandler)))
	if err != nil {
		t.Fatal(err)
	}
	client := func(name string) config.GatewayClient {
		sum := sha256.Sum256([]byte(name + "-secret"))
		return config.GatewayClient{Name: name, KeySHA256: hex.EncodeToString(sum[:])}
	}
	gateway := func(listen string, anonymous bool, clients ...config.GatewayClient) config.File {
		return config.File{Gateway: config.Gateway{Listen: listen, AllowAnonymous: anonymous, Clients: clients, Types: []string{"demo:noop"}}}
	}
	const public, loopback = "192.0.2.2:8080", "127.0.0.1:8080"
	const closed = "no clients configured"
	for _, step := range []struct {
		desc   string
		config config.File
		key    string // "" sends none
		status int    // http.StatusOK: let in
		want   string // in the answer's body
	}{
		{desc: "alice and bob: alice's key", config: gateway(public, false, client("alice"), client("bob")), key: "alice-secret", status: http.StatusOK},
		{desc: "alice revoked: her key", config: gateway(public, false, client("bob")), key: "alice-secret", status: http.StatusUnauthorized, want: "unknown API key"},
		{desc: "alice revoked: bob's key", config: gateway(public, false, client("bob")), key: "bob-secret", status: http.StatusOK},
		{desc: "no clients left: bob's revoked key", config: gateway(public, false), key: "bob-secret", status: http.StatusServiceUnavailable, want: closed},
		{desc: "no clients left: no key", config: gateway(public, false), status: http.StatusServiceUnavailable, want: closed},
		{desc: "no clients left: a made-up key", config: gateway(public, false), key: "guess", status: http.StatusServiceUnavailable, want: closed},
		{desc: "no clients, listening everywhere: no key", config: gateway(":8080", false), status: http.StatusServiceUnavailable, want: closed},
		{desc: "allow_anonymous: no key", config: gateway(public, true), status: http.StatusOK},
		{desc: "a client again: its key", config: gateway(public, false, client("carol")), key: "carol-secret", status: http.StatusOK},
		{desc: "a client again: no key", config: gateway(public, false, client("carol")), status: http.StatusUnauthorized, want: "an API key is required"},
		{desc: "on loopback, no clients: no key", config: gateway(loopback, false), status: http.StatusOK},
	} {
		in.Reload(step.config)
		r := httptest.NewRequest("POST", "/v1/tasks", strings.NewReader(`{"type": "demo:noop"}`))
		if step.key != "" {
			r.Header.Set(APIKeyHeader, step.key)
		}
		w := httptest.NewRecorder()
		in.authenticate(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {})).ServeHTTP(w, r)
		if w.Code != step.status || !strings.Contains(w.Body.String(), step.want) {
			t.Errorf("%s: %d %s, want %d saying %q", step.desc, w.Code, w.Body.String(), step.status, step.want)
		}
	}
}
