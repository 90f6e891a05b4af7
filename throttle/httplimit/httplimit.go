// Package httplimit is net/http middleware that protects a service the way
// a public API does: every request must pass several rate limits at once
// (one for everyone, one per API key, one per client address, one per a
// value the service picks such as a task type), kept in Redis through
// package throttle so that a whole fleet of processes shares them; refusals
// are answered 429 with Retry-After and the RateLimit fields of
// draft-ietf-httpapi-ratelimit-headers; callers that keep being refused are
// banned for longer and longer; and each limit says what to do when Redis
// cannot be reached.
//
//	lim, err := httplimit.New(rdb, httplimit.Config{
//		Limits: []httplimit.Limit{
//			{Name: "overall", Key: httplimit.KeyGlobal, Spec: throttle.Spec{Algorithm: throttle.TokenBucket, Limit: 1000, Period: time.Second, Burst: 2000}},
//			{Name: "per-client", Key: httplimit.KeyClient, Spec: throttle.Spec{Algorithm: throttle.SlidingLog, Limit: 60, Period: time.Minute}},
//			{Name: "per-ip", Key: httplimit.KeyIP, Spec: throttle.Spec{Algorithm: throttle.SlidingCounter, Limit: 300, Period: time.Minute}},
//		},
//		Ban: httplimit.Ban{After: 20, Within: time.Minute, For: 5 * time.Minute, Max: 24 * time.Hour},
//	}, httplimit.WithRegisterer(reg))
//	http.ListenAndServe(addr, lim.Middleware(mux))
//
// # All or nothing
//
// A request refused by one limit uses up nothing in the others: the
// middleware books one event on all of a request's limits at once, now or
// never (throttle.Book with maxWait 0). On a single Redis server that is
// one script run, one round trip, for all the limits. On Redis Cluster the
// limits live in different slots: each slot's limits are counted in one
// script run, all slots at once; if one refuses, the others give theirs
// back exactly (any algorithm). Between the two, a concurrent request sees
// those limits one event fuller than they end up, and may be refused where
// it would have passed: the error is a refusal, never an excess. A give-back
// that fails (Redis lost meanwhile) leaves its event counted.
//
// # Answers
//
// A refusal is answered 429 Too Many Requests with Retry-After (whole
// seconds, rounded up, at least 1) and an application/problem+json body of
// the draft's quota-exceeded type naming the limit. Every answer the limits
// decided, 2xx included, carries the RateLimit-Policy and RateLimit fields
// of the draft (as of -11: Structured Field lists) for one limit: the one that refused, or else the one
// with the fewest requests left. For example
//
//	RateLimit-Policy: "per-client";q=60;w=60
//	RateLimit: "per-client";r=0;t=12
//
// q and w describe the limit: Limit per Period for the windowed
// algorithms, Burst per the time the bucket takes to refill (or drain)
// from Burst for the buckets; w is rounded up to whole seconds, which only
// ever makes the advertised policy stricter. r is the number of requests
// left. t is, on a refusal, the Retry-After; otherwise w: the time after
// which the limit is surely back to full, so a client alone on the limit
// that makes no more than r requests in t seconds is never refused by it. Only the
// named limit is shown, so a client learns nothing of limits that are far
// from refusing it.
//
// # Bans
//
// With Config.Ban set, a client refused Ban.After times within Ban.Within
// is banned for Ban.For; each further ban lasts twice as long as the one
// before, up to Ban.Max; bans are forgiven one per Ban.Forget. A banned
// client is answered 429 (problem type abnormal-usage-detected) with
// Retry-After until the ban ends, and its requests touch no limit. A ban is on the identity that the refusing
// limit counts: refusals by an ip limit ban the client address, refusals
// by a client limit ban the API key. Refusals by global and type limits
// ban no one (they are not one client's doing), nor do refusals of the
// shared "anonymous" client key. A caller that sends a new API key with
// every request is never banned by key; the ip limits and their bans
// still hold it.
//
// Middleware is Bans in front of Limits. A service that checks API keys
// itself puts that check between the two, and reads the request body only
// after it, so a banned or unknown client costs no body read; Refused
// counts such a refusal (401) toward a ban on the client's address.
//
// Bans live in Redis, so the whole fleet agrees on them, and are built
// from throttle limiters keyed by the banned identity (see banner).
// Checking them costs one Redis call per identity of each request (the
// address, and the API key if there is one).
//
// # When Redis fails
//
// Each limit has its own policy (Limit.OnRedisError) for a request it
// cannot count because Redis failed: deny answers 503 Service Unavailable
// (the client exceeded nothing, so 429 would blame it, and a 503 never
// counts toward a ban) with Retry-After 1 and the draft's
// temporary-reduced-capacity problem type; allow lets the request through
// uncounted by that limit; local counts it in an in-process twin of the
// limit (throttle.NewLocal), at the full limit unless Limit.LocalDivisor
// says how many processes share it. Bans whose state cannot be read or
// written are skipped: the limits still hold. Every use of a policy and
// every Redis error is counted in the metrics.
//
// # Metrics
//
// Registered on the Registerer given with WithRegisterer, all under
// sluice_http_, labelled by limit name (from the Config) and result, never
// by client:
//
//	sluice_http_decisions_total{limit, result}         result: allowed, refused; limit "ban": refused by a ban
//	sluice_http_bans_total{key}                        bans given, key: ip or client
//	sluice_http_policy_fallbacks_total{limit, policy}  requests decided by a failure policy: deny, allow or local
//	sluice_http_redis_errors_total{limit}              failed Redis calls; limit "ban" for the bans
package httplimit

import (
	"cmp"
	"fmt"
	"log/slog"
	"net/http"
	"net/netip"
	"slices"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/throttle"
)

// KeyKind names what a Limit counts requests by.
type KeyKind string

// The four kinds of key.
const (
	// KeyGlobal counts all requests together.
	KeyGlobal KeyKind = "global"
	// KeyClient counts per API key (Config.ClientHeader); all requests
	// without one count together as the client "anonymous".
	KeyClient KeyKind = "client"
	// KeyIP counts per client address (see Limiter.Client); IPv6 addresses
	// per network of Config.IPv6Prefix bits.
	KeyIP KeyKind = "ip"
	// KeyType counts per the value the KeyFunc given with WithKeyFunc
	// returns for the request, e.g. the task type it enqueues.
	KeyType KeyKind = "type"
)

// The failure policies of Limit.OnRedisError: package throttle's (see
// throttle.WithOnRedisError).
const (
	OnRedisErrorDeny  = throttle.OnRedisErrorDeny  // answer 503: the request is refused
	OnRedisErrorAllow = throttle.OnRedisErrorAllow // let the request through, uncounted by this limit
	OnRedisErrorLocal = throttle.OnRedisErrorLocal // count the request in an in-process twin of the limit
)

// Limit is one rate limit every request must pass.
type Limit struct {
	// Name names the limit in the RateLimit fields, metrics and logs:
	// letters, digits, '-', '_' and '.'; "ban" is taken.
	Name string
	Key  KeyKind
	Spec throttle.Spec
	// OnRedisError is what the limit does with a request it cannot count
	// because Redis failed: OnRedisErrorDeny (the default),
	// OnRedisErrorAllow or OnRedisErrorLocal.
	OnRedisError string
	// LocalDivisor divides the Spec for the local policy's in-process twin
	// (throttle.Divide), e.g. by the number of processes that share the
	// limit. 0 or 1: the full limit, which a lone
	// process would enforce, and a fleet of n processes n times over.
	LocalDivisor int
}

// Ban turns repeated refusals into a ban. The zero Ban bans no one.
type Ban struct {
	After  int           // refusals within Within that ban a client
	Within time.Duration // at least 1ms
	For    time.Duration // how long a first ban lasts
	Max    time.Duration // the longest ban, each further one lasting twice the one before; 0 means For
	// Forget is how fast bans are forgiven: each ban adds a strike,
	// strikes fade at one per Forget, and a ban lasts For × 2^(strikes-1)
	// (at most Max). 0 means Max.
	Forget time.Duration
}

// Config is the plain configuration of a Limiter, as read from a file.
type Config struct {
	// Limits are the limits every request must pass.
	Limits []Limit
	// TrustedProxies are the networks of the proxies whose X-Forwarded-For
	// is believed (see Limiter.Client). None by default.
	TrustedProxies []netip.Prefix
	// Ban bans clients that keep being refused; the zero Ban bans no one.
	Ban Ban
	// ClientHeader is the request header that holds the API key. Default
	// "X-API-Key".
	ClientHeader string
	// IPv6Prefix is how many leading bits of an IPv6 address name one
	// client for ip limits and bans: a single host usually owns a whole
	// /64. Default 64; 128 counts every address apart.
	IPv6Prefix int
	// Prefix begins every Redis key of the Limiter; it may not contain '{'
	// or '}'. Default "sluice:http:". Limiters with different limits of
	// the same name need different prefixes.
	Prefix string
}

// KeyFunc returns the key of a request for the limits of kind KeyType.
type KeyFunc func(*http.Request) string

// Option configures New.
type Option func(*options)

type options struct {
	clock   throttle.Clock
	reg     prometheus.Registerer
	keyFunc KeyFunc
	log     *slog.Logger
}

// WithClock makes every limiter, on Redis and in process, read time from c
// (see throttle.WithClock). Meant for tests.
func WithClock(c throttle.Clock) Option { return func(o *options) { o.clock = c } }

// WithRegisterer registers the metrics on reg. Without it they are kept but
// not exported.
func WithRegisterer(reg prometheus.Registerer) Option { return func(o *options) { o.reg = reg } }

// WithKeyFunc sets the key of the limits of kind KeyType: f(r) for request
// r. New fails if a limit is of that kind and no KeyFunc is given. f runs
// before the handler, so what it reads must be known by then (a path
// segment, a header, a query parameter).
func WithKeyFunc(f KeyFunc) Option { return func(o *options) { o.keyFunc = f } }

// WithLogger sets where Redis errors are logged, at most one line per limit
// every 10 seconds; API keys and addresses are never logged. Default
// slog.Default().
func WithLogger(log *slog.Logger) Option { return func(o *options) { o.log = log } }

// Limiter enforces a Config on the requests that pass its Middleware.
type Limiter struct {
	limits   []*limit // in the order they are checked
	trusted  []netip.Prefix
	header   string
	v6bits   int
	keyFunc  KeyFunc
	ban      *banner // nil: no bans
	pools    *pools  // nil on a test's clock: leases count on the system's
	metrics  *metrics
	log      *slog.Logger
	logGates throttle.Limiter // keyed by limit name: at most one log line per 10s
}

// limit is a Limit with its limiter (which applies the Limit's failure
// policy itself).
type limit struct {
	Limit
	lim    throttle.Limiter
	quota  int           // q: Limit, or Burst for the buckets
	window time.Duration // w: Period, or the time a bucket takes to refill from empty
}

// New returns a Limiter that keeps its limits and bans in rdb (Redis or
// Redis Cluster). It checks cfg and fails with an error naming the field at
// fault.
func New(rdb redis.UniversalClient, cfg Config, opts ...Option) (*Limiter, error) {
	o := options{reg: prometheus.NewRegistry(), log: slog.Default()}
	for _, opt := range opts {
		opt(&o)
	}
	l := &Limiter{
		trusted: make([]netip.Prefix, len(cfg.TrustedProxies)),
		header:  cmp.Or(cfg.ClientHeader, "X-API-Key"),
		v6bits:  cmp.Or(cfg.IPv6Prefix, 64),
		keyFunc: o.keyFunc,
		log:     o.log,
	}
	for i, p := range cfg.TrustedProxies {
		if !p.IsValid() {
			return nil, fmt.Errorf("httplimit: TrustedProxies[%d] is not a valid network", i)
		}
		l.trusted[i] = p.Masked()
	}
	if l.v6bits < 1 || l.v6bits > 128 {
		return nil, fmt.Errorf("httplimit: IPv6Prefix must be between 1 and 128 (0 means 64), got %d", cfg.IPv6Prefix)
	}
	prefix := cmp.Or(cfg.Prefix, "sluice:http:")
	var throttleOpts []throttle.Option // full: appending to it copies
	if o.clock != nil {
		throttleOpts = []throttle.Option{throttle.WithClock(o.clock)}
	} else {
		l.pools = &pools{set: map[string]*pooled{}}
	}
	seen := map[string]bool{"ban": true}
	for i, cl := range cfg.Limits {
		if !validName(cl.Name) || seen[cl.Name] {
			return nil, fmt.Errorf("httplimit: Limits[%d].Name must be unique, not \"ban\", and made of letters, digits, '-', '_' and '.', got %q", i, cl.Name)
		}
		seen[cl.Name] = true
		lim, err := newLimit(rdb, cl, fmt.Sprintf("httplimit: Limits[%d] (%s)", i, cl.Name), prefix, throttleOpts)
		if err != nil {
			return nil, err
		}
		if lim.Key == KeyType && l.keyFunc == nil {
			return nil, fmt.Errorf("httplimit: Limits[%d] (%s) has Key %q: give its KeyFunc with WithKeyFunc", i, cl.Name, KeyType)
		}
		l.limits = append(l.limits, lim)
	}
	// When several refuse, the one that refuses longest names the refusal;
	// among equals, the one closest to the client.
	rank := map[KeyKind]int{KeyClient: 0, KeyIP: 1, KeyType: 2, KeyGlobal: 3}
	slices.SortStableFunc(l.limits, func(a, b *limit) int { return rank[a.Key] - rank[b.Key] })

	var err error
	if l.ban, err = newBanner(rdb, cfg.Ban, prefix, throttleOpts); err != nil {
		return nil, err
	}
	if l.metrics, err = newMetrics(o.reg); err != nil {
		return nil, err
	}
	l.logGates, err = throttle.NewLocal(throttle.Spec{Algorithm: throttle.SlidingLog, Limit: 1, Period: 10 * time.Second})
	return l, err
}

// newLimit makes the limiters of cl; its errors begin with where.
func newLimit(rdb redis.UniversalClient, cl Limit, where, prefix string, opts []throttle.Option) (*limit, error) {
	switch cl.Key {
	case KeyGlobal, KeyClient, KeyIP, KeyType:
	default:
		return nil, fmt.Errorf("%s: Key must be %q, %q, %q or %q, got %q", where, KeyGlobal, KeyClient, KeyIP, KeyType, cl.Key)
	}
	cl.OnRedisError = cmp.Or(cl.OnRedisError, OnRedisErrorDeny)
	switch cl.OnRedisError {
	case OnRedisErrorDeny, OnRedisErrorAllow, OnRedisErrorLocal:
	default:
		return nil, fmt.Errorf("%s: OnRedisError must be %q, %q or %q, got %q", where, OnRedisErrorDeny, OnRedisErrorAllow, OnRedisErrorLocal, cl.OnRedisError)
	}
	if cl.LocalDivisor < 0 {
		return nil, fmt.Errorf("%s: LocalDivisor must be >= 0, got %d", where, cl.LocalDivisor)
	}
	divisor := max(1, cl.LocalDivisor)
	// The algorithm is part of the prefix: a limit whose algorithm changes
	// must not read the state the old one left.
	opts = append(opts, throttle.WithPrefix(prefix+"limit:"+cl.Name+":"+string(cl.Spec.Algorithm)+":"),
		throttle.WithOnRedisError(cl.OnRedisError, func() int { return divisor }))
	lim, err := throttle.New(rdb, cl.Spec, opts...)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", where, err)
	}
	l := &limit{Limit: cl, lim: lim, quota: cl.Spec.Limit, window: cl.Spec.Period}
	if cl.Spec.Algorithm == throttle.TokenBucket || cl.Spec.Algorithm == throttle.LeakyBucket {
		l.quota = cmp.Or(cl.Spec.Burst, cl.Spec.Limit)
		// In µs, Burst × Period stays below 2^50 (throttle checks it); rounded
		// up so that w never promises more than the bucket gives.
		us := (cl.Spec.Period.Microseconds()*int64(l.quota) + int64(cl.Spec.Limit) - 1) / int64(cl.Spec.Limit)
		l.window = time.Duration(us) * time.Microsecond
	}
	return l, nil
}

// validName reports whether name can stand in a Structured Field string,
// a metric label and a Redis key prefix as it is.
func validName(name string) bool {
	if name == "" {
		return false
	}
	for _, c := range []byte(name) {
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '-' || c == '_' || c == '.') {
			return false
		}
	}
	return true
}
