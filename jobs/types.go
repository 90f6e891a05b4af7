package jobs

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"reflect"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/hibiken/asynq"

	"github.com/sluicehq/sluice/internal/strictjson"
)

// The built-in task types. The names are a contract with producers: tasks
// already in Redis carry them.
const (
	TypeNoop        = "demo:noop"
	TypeSleep       = "demo:sleep"
	TypeHTTPRequest = "http:request"
)

// maxSleepMS is the longest demo:sleep task, one hour.
const maxSleepMS = 3_600_000

// SleepPayload is the payload of a demo:sleep task.
type SleepPayload struct {
	MS int `json:"ms"` // how long to sleep, 0 to 3,600,000 milliseconds
}

// HTTPRequestPayload is the payload of an http:request task. Only URL is
// required.
type HTTPRequestPayload struct {
	Method  string            `json:"method,omitempty"` // a standard method in any case; default GET
	URL     string            `json:"url"`              // absolute http or https URL
	Headers map[string]string `json:"headers,omitempty"`
	Body    string            `json:"body,omitempty"`
}

// UpstreamBusyError reports that a third-party API answered 429 or 503; the
// gates stop drawing on the task type's quotas until RetryAfter has passed
// (an adaptive quota's rate is cut instead, for a RetryAfter up to 5s; see
// ReportUpstream).
// RetryAfter is 0 when the answer had no usable Retry-After header.
type UpstreamBusyError struct {
	Status     int
	RetryAfter time.Duration
	// Ignored, if not empty, says why a Retry-After the upstream sent was
	// not used (in the past, or neither a number nor a date).
	Ignored string
}

// Error implements error.
func (e *UpstreamBusyError) Error() string {
	return fmt.Sprintf("upstream busy: %d %s, retry after %v", e.Status, http.StatusText(e.Status), e.RetryAfter)
}

// UpstreamBusy returns the UpstreamBusyError that resp calls for: for a 429
// or 503 answer, with its Retry-After (delta-seconds or an HTTP-date; 0
// when absent or unusable); nil for any other status. A
// handler that calls a third-party API returns it, wrapped or not, and
// the gates hold back every task of the type's quotas, fleet-wide, until
// the upstream's time is up:
//
//	if busy := jobs.UpstreamBusy(resp); busy != nil {
//		return busy
//	}
func UpstreamBusy(resp *http.Response) *UpstreamBusyError {
	if resp.StatusCode != http.StatusTooManyRequests && resp.StatusCode != http.StatusServiceUnavailable {
		return nil
	}
	busy := &UpstreamBusyError{Status: resp.StatusCode}
	busy.RetryAfter, busy.Ignored = parseRetryAfter(resp.Header.Get("Retry-After"), time.Now())
	return busy
}

// Type describes a built-in task type.
type Type struct {
	Name string
	Doc  string
	// Validate checks a payload before anything is written: strict JSON
	// (no unknown fields, one value, no trailing data) and each field's rules.
	Validate func(payload []byte) error
}

// Types lists the built-in task types, sorted by name.
func Types() []Type {
	return []Type{
		{TypeNoop, `does nothing; payload {} or empty`, func(b []byte) error { return parseNoop(b) }},
		{TypeSleep, `sleeps; payload {"ms": N}, 0 <= N <= 3600000`, func(b []byte) error { _, err := parseSleep(b); return err }},
		{TypeHTTPRequest, `makes an HTTP request to an allowed host, succeeds on 2xx; payload {"method": "GET", "url": "...", "headers": {}, "body": "..."}, only url required`,
			func(b []byte) error { _, err := parseHTTPRequest(b); return err }},
	}
}

// LookupType returns the built-in type called name.
func LookupType(name string) (Type, bool) {
	for _, t := range Types() {
		if t.Name == name {
			return t, true
		}
	}
	return Type{}, false
}

// NewNoopTask returns a demo:noop task.
func NewNoopTask(opts ...asynq.Option) (*asynq.Task, error) {
	return asynq.NewTask(TypeNoop, nil, opts...), nil
}

// NewSleepTask returns a demo:sleep task, or the reason p is invalid.
func NewSleepTask(p SleepPayload, opts ...asynq.Option) (*asynq.Task, error) {
	b, _ := json.Marshal(p) // cannot fail: an int
	if _, err := parseSleep(b); err != nil {
		return nil, err
	}
	return asynq.NewTask(TypeSleep, b, opts...), nil
}

// NewHTTPRequestTask returns an http:request task, or the reason p is invalid.
func NewHTTPRequestTask(p HTTPRequestPayload, opts ...asynq.Option) (*asynq.Task, error) {
	b, _ := json.Marshal(p) // cannot fail: strings only
	if _, err := parseHTTPRequest(b); err != nil {
		return nil, err
	}
	return asynq.NewTask(TypeHTTPRequest, b, opts...), nil
}

// Mux is where Register puts the handlers: an *asynq.ServeMux, or a
// *worker.Worker (package github.com/sluicehq/sluice/worker).
type Mux interface {
	Handle(pattern string, handler asynq.Handler)
}

// Register registers the handlers of the built-in types on mux. The
// http:request handler calls only what allow permits (see AllowList),
// with a 30s timeout per call.
func Register(mux Mux, allow AllowList) {
	mux.Handle(TypeNoop, asynq.HandlerFunc(func(_ context.Context, t *asynq.Task) error {
		return skipRetry(parseNoop(t.Payload()))
	}))
	mux.Handle(TypeSleep, asynq.HandlerFunc(handleSleep))
	mux.Handle(TypeHTTPRequest, newHTTPRequestHandler(allow))
}

// skipRetry marks a payload error so asynq archives the task: it would fail
// the same way on every retry.
func skipRetry(err error) error {
	if err == nil {
		return nil
	}
	return fmt.Errorf("%w (%w)", err, asynq.SkipRetry)
}

func handleSleep(ctx context.Context, t *asynq.Task) error {
	p, err := parseSleep(t.Payload())
	if err != nil {
		return skipRetry(err)
	}
	timer := time.NewTimer(time.Duration(p.MS) * time.Millisecond)
	defer timer.Stop()
	select {
	case <-timer.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// maxDrain bounds how much of a response body is read: reading it to the end
// lets the connection be reused, but a huge body is not worth the wait.
const maxDrain = 64 << 10

type httpRequestHandler struct {
	allow  AllowList
	client *http.Client
}

func newHTTPRequestHandler(allow AllowList) *httpRequestHandler {
	h := &httpRequestHandler{allow: allow}
	dialer := &net.Dialer{
		Timeout:   10 * time.Second,
		KeepAlive: 30 * time.Second,
		// Control sees each address after DNS, just before the connection
		// is made: the one place a name that resolves somewhere it should
		// not (127.0.0.1, 169.254.169.254) can be caught, on every redirect
		// too.
		Control: func(_, address string, _ syscall.RawConn) error { return allow.checkDial(address) },
	}
	transport := &http.Transport{
		// No proxy, whatever HTTP_PROXY says: a proxy would dial for us,
		// out of reach of the check on the address dialled.
		Proxy:             nil,
		DialContext:       dialer.DialContext,
		ForceAttemptHTTP2: true,
		MaxIdleConns:      100,
		// A worker calls few APIs, each often: keep connections to each
		// (net/http keeps 2), so a call is not made late by a new one.
		MaxIdleConnsPerHost:   32,
		IdleConnTimeout:       90 * time.Second,
		TLSHandshakeTimeout:   10 * time.Second,
		ExpectContinueTimeout: time.Second,
	}
	h.client = &http.Client{
		Timeout:   30 * time.Second,
		Transport: transport,
		CheckRedirect: func(req *http.Request, via []*http.Request) error {
			if err := allow.checkURL(req.URL); err != nil {
				return fmt.Errorf("redirect to %s: %w: %w", req.URL.Redacted(), err, asynq.SkipRetry)
			}
			if len(via) >= 10 { // net/http's default policy, which a CheckRedirect replaces
				return errors.New("stopped after 10 redirects")
			}
			return nil
		},
	}
	return h
}

func (h *httpRequestHandler) ProcessTask(ctx context.Context, t *asynq.Task) error {
	p, err := parseHTTPRequest(t.Payload())
	if err != nil {
		return skipRetry(err)
	}
	req, err := http.NewRequestWithContext(ctx, p.Method, p.URL, strings.NewReader(p.Body))
	if err != nil {
		return skipRetry(fmt.Errorf("%s: %w", TypeHTTPRequest, err))
	}
	if err := h.allow.checkURL(req.URL); err != nil {
		return fmt.Errorf("%s: %w: %w", TypeHTTPRequest, err, asynq.SkipRetry)
	}
	for k, v := range p.Headers {
		req.Header.Set(k, v)
	}
	resp, err := h.client.Do(req)
	var refused *RefusedAddressError
	var redirected *url.Error
	switch {
	case errors.As(err, &refused) && errors.As(err, &redirected):
		// It will never pass: the name resolves where it may not go.
		return fmt.Errorf("%s: host %q: %w: %w", TypeHTTPRequest, hostOf(redirected.URL), refused, asynq.SkipRetry)
	case err != nil:
		return fmt.Errorf("%s: %w", TypeHTTPRequest, err)
	}
	defer func() {
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, maxDrain))
		resp.Body.Close()
	}()
	busy := UpstreamBusy(resp)
	if busy != nil || resp.StatusCode/100 == 2 {
		// For the adaptive quotas: what the upstream said of its limit too.
		ReportUpstream(ctx, UpstreamAnswer{Busy: busy != nil, Allowance: UpstreamAllowance(resp.Header)})
	}
	if busy != nil {
		return fmt.Errorf("%s: %s %s: %w", TypeHTTPRequest, p.Method, req.URL.Redacted(), busy)
	}
	if resp.StatusCode < 200 || resp.StatusCode >= 300 {
		return fmt.Errorf("%s: %s %s: %s", TypeHTTPRequest, p.Method, req.URL.Redacted(), resp.Status)
	}
	return nil
}

// hostOf is the host of a URL as a url.Error gives it.
func hostOf(rawURL string) string {
	u, err := url.Parse(rawURL)
	if err != nil {
		return rawURL
	}
	return u.Hostname()
}

// parseRetryAfter reads a Retry-After value, delta-seconds or an HTTP-date
// (RFC 9110 10.2.3), as a wait from now; absent, unparsable or past is 0,
// and then the second result says why, for the log.
func parseRetryAfter(v string, now time.Time) (time.Duration, string) {
	v = strings.TrimSpace(v)
	if v == "" {
		return 0, ""
	}
	if s, err := strconv.ParseInt(v, 10, 64); err == nil {
		if s < 0 || s > int64(1<<63-1)/int64(time.Second) {
			return 0, fmt.Sprintf("Retry-After %.40q is out of range", v)
		}
		return time.Duration(s) * time.Second, ""
	}
	t, err := http.ParseTime(v)
	switch {
	case err != nil:
		return 0, fmt.Sprintf("Retry-After %.40q is neither seconds nor an HTTP-date", v)
	case !t.After(now):
		return 0, fmt.Sprintf("Retry-After %.40q is in the past", v)
	}
	return t.Sub(now), ""
}

func parseNoop(b []byte) error {
	if len(bytes.TrimSpace(b)) == 0 {
		return nil
	}
	return decode(TypeNoop, b, &struct{}{})
}

func parseSleep(b []byte) (SleepPayload, error) {
	var p SleepPayload
	if err := decode(TypeSleep, b, &p); err != nil {
		return p, err
	}
	if p.MS < 0 || p.MS > maxSleepMS {
		return p, fmt.Errorf("%s: payload: field \"ms\" must be between 0 and %d, got %d", TypeSleep, maxSleepMS, p.MS)
	}
	return p, nil
}

// httpMethods are the methods an http:request may use. CONNECT is left out:
// it opens a tunnel rather than making a request.
var httpMethods = []string{
	http.MethodGet, http.MethodHead, http.MethodPost, http.MethodPut,
	http.MethodPatch, http.MethodDelete, http.MethodOptions, http.MethodTrace,
}

// reservedHeaders are written by net/http from the URL and body, which would
// silently override a payload's value.
var reservedHeaders = []string{"Host", "Content-Length", "Transfer-Encoding"}

// parseHTTPRequest decodes and checks an http:request payload; the payload it
// returns has Method set and in upper case.
func parseHTTPRequest(b []byte) (HTTPRequestPayload, error) {
	var p HTTPRequestPayload
	if err := decode(TypeHTTPRequest, b, &p); err != nil {
		return p, err
	}
	bad := func(format string, args ...any) (HTTPRequestPayload, error) {
		return p, fmt.Errorf("%s: payload: %s", TypeHTTPRequest, fmt.Sprintf(format, args...))
	}
	if strings.TrimSpace(p.URL) == "" {
		return bad(`"url" is required`)
	}
	u, err := url.Parse(p.URL)
	if err != nil || !u.IsAbs() || (u.Scheme != "http" && u.Scheme != "https") || u.Hostname() == "" {
		return bad(`field "url" must be an absolute http or https URL, got %q`, p.URL)
	}
	if p.Method == "" {
		p.Method = http.MethodGet
	}
	p.Method = strings.ToUpper(p.Method)
	if !contains(httpMethods, p.Method) {
		return bad(`field "method" must be one of %s, got %q`, strings.Join(httpMethods, ", "), p.Method)
	}
	for k, v := range p.Headers {
		switch {
		case !isToken(k):
			return bad(`field "headers": invalid header name %q`, k)
		case strings.ContainsAny(v, "\r\n\x00"):
			return bad(`field "headers": value of %q must not contain CR, LF or NUL`, k)
		case contains(reservedHeaders, http.CanonicalHeaderKey(k)):
			return bad(`field "headers": %q is set from "url" and "body"`, k)
		}
	}
	return p, nil
}

func contains(list []string, s string) bool {
	for _, v := range list {
		if v == s {
			return true
		}
	}
	return false
}

// isToken reports whether s is an RFC 9110 token, the syntax of a header name.
func isToken(s string) bool {
	if s == "" {
		return false
	}
	for _, c := range []byte(s) {
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0) {
			return false
		}
	}
	return true
}

// decode strictly decodes one JSON object from b into v; its errors name
// the type, the offset or the field at fault.
func decode(name string, b []byte, v any) error {
	err := strictjson.Decode(b, v)
	var bad *strictjson.Error
	if errors.As(err, &bad) && bad.Problem == strictjson.WrongType {
		return fmt.Errorf("%s: payload: field %q: want %s, got %s", name, bad.Field, jsonKind(bad.Type), bad.Got)
	}
	if err != nil {
		return fmt.Errorf("%s: payload: %w", name, err)
	}
	return nil
}

func jsonKind(t reflect.Type) string {
	switch t.Kind() {
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64,
		reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		return "an integer"
	case reflect.String:
		return "a string"
	case reflect.Map, reflect.Struct:
		return "an object"
	}
	return t.String()
}
