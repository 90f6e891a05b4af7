package jobs

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hibiken/asynq"
)

func TestTypesSortedAndLookup(t *testing.T) {
	var names []string
	for _, typ := range Types() {
		names = append(names, typ.Name)
		if got, ok := LookupType(typ.Name); !ok || got.Name != typ.Name {
			t.Errorf("LookupType(%q) = %q, %v", typ.Name, got.Name, ok)
		}
	}
	if want := []string{TypeNoop, TypeSleep, TypeHTTPRequest}; strings.Join(names, ",") != strings.Join(want, ",") {
		t.Errorf("Types() names = %v, want %v", names, want)
	}
	if _, ok := LookupType("demo:nope"); ok {
		t.Error(`LookupType("demo:nope") found a type`)
	}
}

func TestTypeValidate(t *testing.T) {
	tests := []struct {
		desc    string
		typ     string
		payload string
		wantErr string // "" means valid
	}{
		{"noop empty", TypeNoop, ``, ""},
		{"noop object", TypeNoop, ` {} `, ""},
		{"noop unknown field", TypeNoop, `{"x":1}`, `demo:noop: payload: unknown field "x"`},
		{"noop null", TypeNoop, `null`, `demo:noop: payload: want a JSON object, got null`},
		{"sleep ok", TypeSleep, `{"ms": 250}`, ""},
		{"sleep zero", TypeSleep, `{"ms": 0}`, ""},
		{"sleep max", TypeSleep, `{"ms": 3600000}`, ""},
		{"sleep negative", TypeSleep, `{"ms": -5}`, `demo:sleep: payload: field "ms" must be between 0 and 3600000, got -5`},
		{"sleep too long", TypeSleep, `{"ms": 3600001}`, `demo:sleep: payload: field "ms" must be between 0 and 3600000, got 3600001`},
		{"sleep fraction", TypeSleep, `{"ms": 1.5}`, `demo:sleep: payload: field "ms": want an integer, got number 1.5`},
		{"sleep string", TypeSleep, `{"ms": "5"}`, `demo:sleep: payload: field "ms": want an integer, got string`},
		{"sleep empty", TypeSleep, ``, `demo:sleep: payload: empty, want a JSON object`},
		{"sleep array", TypeSleep, `[1]`, `demo:sleep: payload: want a JSON object, got array`},
		{"sleep truncated", TypeSleep, `{"ms": 5`, `demo:sleep: payload: invalid JSON at byte 8: unexpected end of input`},
		{"sleep trailing object", TypeSleep, `{"ms": 5} {}`, `demo:sleep: payload: invalid JSON at byte 10: data after the first value`},
		{"sleep trailing garbage", TypeSleep, `{"ms": 5}x`, `demo:sleep: payload: invalid JSON at byte 9: data after the first value`},
		{"http minimal", TypeHTTPRequest, `{"url": "https://api.example.com/v1"}`, ""},
		{"http full", TypeHTTPRequest, `{"method": "post", "url": "http://[::1]:8080/x?q=1", "headers": {"X-Key": "k"}, "body": "hi"}`, ""},
		{"http url missing", TypeHTTPRequest, `{"method": "GET"}`, `http:request: payload: "url" is required`},
		{"http url blank", TypeHTTPRequest, `{"url": "  "}`, `http:request: payload: "url" is required`},
		{"http url relative", TypeHTTPRequest, `{"url": "/v1"}`, `http:request: payload: field "url" must be an absolute http or https URL, got "/v1"`},
		{"http url ftp", TypeHTTPRequest, `{"url": "ftp://h/x"}`, `http:request: payload: field "url" must be an absolute http or https URL, got "ftp://h/x"`},
		{"http url no host", TypeHTTPRequest, `{"url": "http:///x"}`, `http:request: payload: field "url" must be an absolute http or https URL, got "http:///x"`},
		{"http unknown field", TypeHTTPRequest, `{"urll": "https://a"}`, `http:request: payload: unknown field "urll"`},
		{"http bad JSON", TypeHTTPRequest, `{"url": "https://a" "method": "GET"}`, `http:request: payload: invalid JSON at byte 21: invalid character '"' after object key:value pair`},
		{"http method unknown", TypeHTTPRequest, `{"url": "https://a", "method": "FETCH"}`, `http:request: payload: field "method" must be one of GET, HEAD, POST, PUT, PATCH, DELETE, OPTIONS, TRACE, got "FETCH"`},
		{"http method CONNECT", TypeHTTPRequest, `{"url": "https://a", "method": "connect"}`, `field "method" must be one of`},
		{"http headers not object", TypeHTTPRequest, `{"url": "https://a", "headers": ["a"]}`, `http:request: payload: field "headers": want an object, got array`},
		{"http header value number", TypeHTTPRequest, `{"url": "https://a", "headers": {"A": 1}}`, `http:request: payload: field "headers": want a string, got number`},
		{"http header bad name", TypeHTTPRequest, `{"url": "https://a", "headers": {"X Y": "1"}}`, `http:request: payload: field "headers": invalid header name "X Y"`},
		{"http header CRLF", TypeHTTPRequest, `{"url": "https://a", "headers": {"X": "1\r\nY: 2"}}`, `http:request: payload: field "headers": value of "X" must not contain CR, LF or NUL`},
		{"http header Host", TypeHTTPRequest, `{"url": "https://a", "headers": {"host": "b"}}`, `http:request: payload: field "headers": "host" is set from "url" and "body"`},
	}
	for _, tt := range tests {
		t.Run(tt.desc, func(t *testing.T) {
			typ, ok := LookupType(tt.typ)
			if !ok {
				t.Fatalf("no type %q", tt.typ)
			}
			err := typ.Validate([]byte(tt.payload))
			switch {
			case tt.wantErr == "" && err != nil:
				t.Fatalf("Validate(%s) = %v, want nil", tt.payload, err)
			case tt.wantErr != "" && err == nil:
				t.Fatalf("Validate(%s) = nil, want %q", tt.payload, tt.wantErr)
			case tt.wantErr != "" && !strings.Contains(err.Error(), tt.wantErr):
				t.Fatalf("Validate(%s) = %q, want %q", tt.payload, err, tt.wantErr)
			}
		})
	}
}

func TestNewTaskValidates(t *testing.T) {
	if _, err := NewSleepTask(SleepPayload{MS: -1}); err == nil {
		t.Error("NewSleepTask(ms -1) = nil error")
	}
	if _, err := NewHTTPRequestTask(HTTPRequestPayload{Method: "GET"}); err == nil {
		t.Error("NewHTTPRequestTask(no url) = nil error")
	}
	task, err := NewHTTPRequestTask(HTTPRequestPayload{URL: "https://a.example/?x=1&y=2"}, asynq.MaxRetry(3))
	if err != nil || task.Type() != TypeHTTPRequest {
		t.Fatalf("NewHTTPRequestTask = %v, %v", task, err)
	}
	if err := Types()[2].Validate(task.Payload()); err != nil {
		t.Errorf("payload %s of a constructed task is invalid: %v", task.Payload(), err)
	}
	if task, err := NewNoopTask(); err != nil || task.Type() != TypeNoop {
		t.Errorf("NewNoopTask = %v, %v", task, err)
	}
}

// process runs a task through the handlers Register installs, with the
// http.allow entries allow.
func process(ctx context.Context, t *testing.T, allow []string, typ, payload string) error {
	t.Helper()
	list, err := ParseAllowList(allow)
	if err != nil {
		t.Fatal(err)
	}
	mux := asynq.NewServeMux()
	Register(mux, list)
	return mux.ProcessTask(ctx, asynq.NewTask(typ, []byte(payload)))
}

func TestHTTPRequestStatus(t *testing.T) {
	const inTenSeconds = "in ten seconds" // an HTTP-date, made when the request is answered
	tests := []struct {
		desc       string
		status     int
		retryAfter string
		wantBusy   *UpstreamBusyError // non-nil: an UpstreamBusyError, RetryAfter ±1s
		wantErr    bool
	}{
		{desc: "200", status: 200},
		{desc: "204", status: 204},
		{desc: "500 is retried", status: 500, wantErr: true},
		{desc: "404 is retried", status: 404, wantErr: true},
		{desc: "429 delta-seconds", status: 429, retryAfter: "2", wantBusy: &UpstreamBusyError{Status: 429, RetryAfter: 2 * time.Second}},
		{desc: "503 HTTP-date", status: 503, retryAfter: inTenSeconds, wantBusy: &UpstreamBusyError{Status: 503, RetryAfter: 10 * time.Second}},
		{desc: "429 no Retry-After", status: 429, wantBusy: &UpstreamBusyError{Status: 429}},
		{desc: "503 unparsable Retry-After", status: 503, retryAfter: "soon", wantBusy: &UpstreamBusyError{Status: 503}},
	}
	for _, tt := range tests {
		t.Run(tt.desc, func(t *testing.T) {
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				switch tt.retryAfter {
				case "":
				case inTenSeconds:
					// HTTP-dates are whole seconds: rounded up, so the wait read is
					// 10s less the time the answer takes to be read.
					w.Header().Set("Retry-After", time.Now().Add(10*time.Second).Truncate(time.Second).Add(time.Second).UTC().Format(http.TimeFormat))
				default:
					w.Header().Set("Retry-After", tt.retryAfter)
				}
				w.WriteHeader(tt.status)
			}))
			defer srv.Close()
			err := process(context.Background(), t, []string{srv.Listener.Addr().String()}, TypeHTTPRequest, `{"url": "`+srv.URL+`/x"}`)
			if errors.Is(err, asynq.SkipRetry) {
				t.Fatalf("error %v wraps SkipRetry; want it retried", err)
			}
			var busy *UpstreamBusyError
			switch {
			case tt.wantBusy != nil:
				if !errors.As(err, &busy) {
					t.Fatalf("error %v, want an UpstreamBusyError", err)
				}
				if d := busy.RetryAfter - tt.wantBusy.RetryAfter; busy.Status != tt.wantBusy.Status || d < -time.Second || d > time.Second {
					t.Errorf("got %+v, want %+v (RetryAfter ±1s)", *busy, *tt.wantBusy)
				}
			case tt.wantErr:
				if err == nil || errors.As(err, &busy) {
					t.Errorf("error %v, want an ordinary error", err)
				}
			case err != nil:
				t.Errorf("error %v, want nil", err)
			}
		})
	}
}

func TestHTTPRequestSendsAsGiven(t *testing.T) {
	var got struct {
		method, path, header, body string
	}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		got.method, got.path, got.header, got.body = r.Method, r.URL.RequestURI(), r.Header.Get("X-Api-Key"), string(b)
	}))
	defer srv.Close()
	payload := `{"method": "put", "url": "` + srv.URL + `/items/7?v=2", "headers": {"x-api-key": "s3cret"}, "body": "{\"n\":1}"}`
	if err := process(context.Background(), t, []string{srv.Listener.Addr().String()}, TypeHTTPRequest, payload); err != nil {
		t.Fatal(err)
	}
	if got.method != "PUT" || got.path != "/items/7?v=2" || got.header != "s3cret" || got.body != `{"n":1}` {
		t.Errorf("server saw %+v", got)
	}
}

// TestHTTPRequestAllowList (9.1): a URL passes only with an entry for its
// host and port; the address dialled is checked after DNS and on every
// redirect, so a listed name that resolves to loopback is refused unless
// the address is listed too; a refusal will never pass (SkipRetry) and
// names host, address and why.
func TestHTTPRequestAllowList(t *testing.T) {
	var hits atomic.Int32
	var other *httptest.Server
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		switch r.URL.Path {
		case "/away":
			http.Redirect(w, r, "http://not-allowed.example/x", http.StatusFound)
		case "/home":
			http.Redirect(w, r, "/done", http.StatusFound)
		case "/to-localhost":
			http.Redirect(w, r, "http://localhost:"+port(other)+"/", http.StatusFound)
		}
	}))
	defer srv.Close()
	other = httptest.NewServer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) { hits.Add(1) }))
	defer other.Close()
	addr := srv.Listener.Addr().String()
	tests := []struct {
		desc     string
		allow    []string
		url      string
		wantErr  string // "": success; else the error says it, with SkipRetry
		wantHits int32
	}{
		{"allowed address and port", []string{addr}, srv.URL + "/", "", 1},
		{"allowed by CIDR and port", []string{"127.0.0.0/8:" + port(srv)}, srv.URL + "/", "", 1},
		{"an address without a port means 80 and 443 only", []string{"127.0.0.1"}, srv.URL + "/", "address 127.0.0.1 port " + port(srv) + " is not in http.allow", 0},
		{"the attack of 9.1: any port of 127.0.0.1", []string{"127.0.0.1", "localhost"}, "http://127.0.0.1:" + port(srv) + "/ui/api/queues", "not in http.allow", 0},
		{"host not listed", []string{"api.example.com"}, srv.URL + "/", `address 127.0.0.1 port`, 0},
		{"no allow list", nil, srv.URL + "/", "not in http.allow", 0},
		{"a listed name resolving to loopback", []string{"localhost:" + port(srv)}, "http://localhost:" + port(srv) + "/",
			`host "localhost": address `, 0},
		{"a listed name with its loopback address listed too", []string{"LOCALHOST:" + port(srv), "127.0.0.1:" + port(srv)}, "http://localHost:" + port(srv) + "/", "", 1},
		{"redirect within allowed host", []string{addr}, srv.URL + "/home", "", 2},
		{"redirect to host not listed", []string{addr}, srv.URL + "/away", `redirect to http://not-allowed.example/x: host "not-allowed.example" port 80 is not in http.allow`, 1},
		{"redirect to a listed name resolving to loopback", []string{addr, "localhost:" + port(other)}, srv.URL + "/to-localhost",
			`host "localhost": address `, 1},
	}
	for _, tt := range tests {
		t.Run(tt.desc, func(t *testing.T) {
			hits.Store(0)
			err := process(context.Background(), t, tt.allow, TypeHTTPRequest, `{"url": "`+tt.url+`"}`)
			switch {
			case tt.wantErr == "" && err != nil:
				t.Errorf("error %v, want nil", err)
			case tt.wantErr != "" && (!errors.Is(err, asynq.SkipRetry) || !strings.Contains(err.Error(), tt.wantErr)):
				t.Errorf("error %v, want SkipRetry saying %q", err, tt.wantErr)
			}
			if strings.Contains(tt.wantErr, "address ") && strings.Contains(tt.wantErr, "host ") && !strings.Contains(fmt.Sprint(err), "is loopback and not in http.allow") {
				t.Errorf("error %v does not say the address is loopback", err)
			}
			if n := hits.Load(); n != tt.wantHits {
				t.Errorf("servers got %d requests, want %d", n, tt.wantHits)
			}
		})
	}
}

func port(srv *httptest.Server) string {
	return strconv.Itoa(srv.Listener.Addr().(*net.TCPAddr).Port)
}

// TestHTTPRequestNoProxy (9.1): the handler dials itself whatever
// HTTP_PROXY says; a proxy would reach what the dial check refuses.
func TestHTTPRequestNoProxy(t *testing.T) {
	h := newHTTPRequestHandler(AllowList{})
	if tr, ok := h.client.Transport.(*http.Transport); !ok || tr.Proxy != nil {
		t.Errorf("transport %T with a proxy function; want an *http.Transport with Proxy nil", h.client.Transport)
	}
}

// TestAllowList (9.1): the entries of http.allow, and which URLs and dials
// they let through.
func TestAllowList(t *testing.T) {
	list, err := ParseAllowList([]string{"API.example.com", "api.example.com:8443", "[::1]:9000", "203.0.113.7", "10.20.0.0/16:8080", "[fd00::/8]:8080", "169.254.169.254:80", "2001:db8::1"})
	if err != nil {
		t.Fatal(err)
	}
	for _, tt := range []struct {
		desc, url string
		want      bool
	}{
		{"name, http default port", "http://api.example.com/x", true},
		{"name, https default port", "https://Api.Example.COM/x", true},
		{"name with a trailing dot", "https://api.example.com./x", true},
		{"name, listed port", "https://api.example.com:8443/x", true},
		{"name, other port", "http://api.example.com:8080/x", false},
		{"name, https port on http", "http://api.example.com:443/x", false},
		{"subdomain", "https://x.api.example.com/", false},
		{"suffix", "https://api.example.com.evil.test/", false},
		{"userinfo trick", "https://api.example.com@evil.test/", false},
		{"IPv6 with its port", "http://[::1]:9000/", true},
		{"IPv6 other port", "http://[::1]:8080/", false},
		{"bare IPv6 entry, default port", "https://[2001:db8::1]/", true},
		{"IPv4, default port", "https://203.0.113.7/", true},
		{"IPv4, other port", "http://203.0.113.7:8080/", false},
		{"CIDR with port", "http://10.20.3.4:8080/", true},
		{"CIDR, other port", "http://10.20.3.4/", false},
		{"outside the CIDR", "http://10.21.0.1:8080/", false},
		{"IPv6 CIDR with port", "http://[fd12::1]:8080/", true},
		{"IPv4-mapped IPv6", "http://[::ffff:10.20.0.1]:8080/", true},
	} {
		u, err := url.Parse(tt.url)
		if err != nil {
			t.Fatal(err)
		}
		if err := list.checkURL(u); (err == nil) != tt.want {
			t.Errorf("%s: checkURL(%s) = %v, want allowed %v", tt.desc, tt.url, err, tt.want)
		}
	}
	for _, tt := range []struct {
		address string
		why     string // "": allowed
	}{
		{"93.184.215.14:443", ""},
		{"[2606:2800:21f:cb07:6820:80da:af6b:8b2c]:443", ""},
		{"127.0.0.1:80", "loopback"},
		{"[::1]:9000", ""},
		{"[::1]:80", "loopback"},
		{"[::ffff:127.0.0.1]:80", "loopback"},
		{"169.254.169.254:80", ""},
		{"169.254.169.254:8080", "link-local (the cloud metadata service)"},
		{"169.254.1.1:80", "link-local"},
		{"[fe80::1]:443", "link-local"},
		{"10.20.9.9:8080", ""},
		{"10.20.9.9:443", "private"},
		{"172.16.0.1:443", "private"},
		{"192.168.1.1:443", "private"},
		{"[fd12::1]:8080", ""},
		{"[fc00::1]:443", "private"},
		{"100.64.0.1:443", "carrier-grade NAT"},
		{"0.0.0.0:80", "unspecified"},
		{"[::]:80", "unspecified"},
		{"224.0.0.1:80", "multicast"},
		{"[ff02::1]:80", "multicast"},
		{"255.255.255.255:80", "reserved"},
	} {
		err := list.checkDial(tt.address)
		var refused *RefusedAddressError
		switch {
		case tt.why == "" && err != nil:
			t.Errorf("checkDial(%s) = %v, want nil", tt.address, err)
		case tt.why != "" && (!errors.As(err, &refused) || refused.Why != tt.why):
			t.Errorf("checkDial(%s) = %v, want refused as %s", tt.address, err, tt.why)
		}
	}
	for _, bad := range []struct{ entry, want string }{
		{"api.example.com:0", "the port must be a number from 1 to 65535"},
		{"api.example.com:http", "the port must be a number"},
		{"api.example.com:", "the port is missing"},
		{"[::1", "missing ']'"},
		{"[::1]9000", "want [address]:port"},
		{"10.0.0.1/8", "did you mean 10.0.0.0/8?"},
		{"http://api.example.com", "is a URL; give its host"},
		{"*.example.com", "is not a host name"},
		{"", "is not a host name"},
	} {
		if _, err := ParseAllowList([]string{"ok.example.com", bad.entry}); err == nil || !strings.Contains(err.Error(), "http.allow[1]: ") || !strings.Contains(err.Error(), bad.want) {
			t.Errorf("ParseAllowList(%q) = %v, want an error naming http.allow[1] and saying %q", bad.entry, err, bad.want)
		}
	}
}

func TestParseRetryAfter(t *testing.T) {
	now := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	tests := []struct {
		desc, value string
		want        time.Duration
		ignored     string // in the reason it was ignored; "" when used
	}{
		{"absent", "", 0, ""},
		{"seconds", "120", 2 * time.Minute, ""},
		{"zero", "0", 0, ""},
		{"negative", "-3", 0, "out of range"},
		{"overflow", "99999999999999999999", 0, "neither seconds nor an HTTP-date"},
		{"date", now.Add(90 * time.Second).Format(http.TimeFormat), 90 * time.Second, ""},
		{"past date", now.Add(-time.Hour).Format(http.TimeFormat), 0, "in the past"},
		{"garbage", "tomorrow", 0, "neither seconds nor an HTTP-date"},
	}
	for _, tt := range tests {
		t.Run(tt.desc, func(t *testing.T) {
			got, ignored := parseRetryAfter(tt.value, now)
			if got != tt.want || (tt.ignored == "") != (ignored == "") || !strings.Contains(ignored, tt.ignored) {
				t.Errorf("parseRetryAfter(%q) = %v, %q; want %v and a reason saying %q", tt.value, got, ignored, tt.want, tt.ignored)
			}
		})
	}
}

func TestSleepHonoursCancel(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	time.AfterFunc(20*time.Millisecond, cancel)
	start := time.Now()
	err := process(ctx, t, nil, TypeSleep, `{"ms": 3600000}`)
	if !errors.Is(err, context.Canceled) {
		t.Errorf("error %v, want context.Canceled", err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("returned after %v, want soon after cancel", d)
	}
}

func TestSleepAndNoopHandlers(t *testing.T) {
	tests := []struct {
		desc, typ, payload string
		wantSkip           bool
	}{
		{"sleep", TypeSleep, `{"ms": 1}`, false},
		{"noop", TypeNoop, `{}`, false},
		{"noop empty", TypeNoop, ``, false},
		{"sleep bad payload is not retried", TypeSleep, `{"ms": -1}`, true},
		{"noop bad payload is not retried", TypeNoop, `{"x": 1}`, true},
	}
	for _, tt := range tests {
		t.Run(tt.desc, func(t *testing.T) {
			err := process(context.Background(), t, nil, tt.typ, tt.payload)
			if skip := errors.Is(err, asynq.SkipRetry); skip != tt.wantSkip || (!tt.wantSkip && err != nil) {
				t.Errorf("error %v, want SkipRetry %v", err, tt.wantSkip)
			}
		})
	}
}
