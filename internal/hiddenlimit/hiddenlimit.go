// Package hiddenlimit is a stand-in for a third-party API whose rate limit
// its callers are not told and which changes by phases, and the harness
// that drives a fleet of real worker processes against it with a backlog
// of http:request tasks. The adaptive quotas' end-to-end test (test/) and
// the bench's adaptive section (cmd/bench) run the same harness, so the
// figures in docs/benchmarks.md and the test's assertions are of one thing.
package hiddenlimit

import (
	"cmp"
	"context"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/internal/testkit"
	"github.com/sluicehq/sluice/jobs"
)

// Phase is a stretch of time for which the API allows Limit calls a second.
type Phase struct {
	Limit int
	For   time.Duration
}

// API answers each call 200 while its token bucket (the phase's limit a
// second, burst a fifth of a second of it, at least 1) has a token, and
// 429 with Retry-After: 1 beyond it. With State, it states its limit in
// every answer (RateLimit-Policy and X-RateLimit-Limit, per second).
//
// A keyed API (NewKeyedAPI) has a limit per key value instead, the value a
// call's KeyHeader names (a destination, a customer's token): each value
// its own bucket, its own limit for the whole run.
type API struct {
	*httptest.Server
	phases []Phase
	state  bool
	keyed  map[string]int // a keyed API's limits, by key value; nil: not keyed

	mu      sync.Mutex
	start   time.Time // of the first phase; zero: not started (every call answered 200)
	buckets map[string]*bucket
	calls   []Call
	ok      map[string]int // successes per path
}

// KeyHeader names a call's key value on a keyed API.
const KeyHeader = "X-Dest"

type bucket struct {
	tokens float64
	last   time.Time
}

// Call is one call the API answered: when (since the first phase began),
// whether it got through, and on a keyed API its key value.
type Call struct {
	At  time.Duration
	OK  bool
	Key string
}

// NewAPI starts an API with phases; they begin at Start.
func NewAPI(phases []Phase, state bool) *API {
	a := &API{phases: phases, state: state, ok: map[string]int{}}
	a.Server = httptest.NewServer(http.HandlerFunc(a.serve))
	return a
}

// NewKeyedAPI starts an API that allows each key value (KeyHeader) its own
// limit a second, for a run of d.
func NewKeyedAPI(limits map[string]int, d time.Duration) *API {
	a := NewAPI([]Phase{{For: d}}, false)
	a.keyed = limits
	return a
}

// Start begins the first phase now, and returns when.
func (a *API) Start() time.Time {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.start = time.Now()
	a.buckets = map[string]*bucket{}
	return a.start
}

func (a *API) burst(limit int) float64 { return math.Max(1, float64(limit)/5) }

// limitAt is the phase's limit at d since the start (the last phase's
// after the end).
func (a *API) limitAt(d time.Duration) int {
	for _, p := range a.phases {
		if d < p.For {
			return p.Limit
		}
		d -= p.For
	}
	return a.phases[len(a.phases)-1].Limit
}

func (a *API) serve(w http.ResponseWriter, r *http.Request) {
	a.mu.Lock()
	now := time.Now()
	allowed, limit := true, 0
	if !a.start.IsZero() {
		key := ""
		limit = a.limitAt(now.Sub(a.start))
		if a.keyed != nil {
			key = r.Header.Get(KeyHeader)
			limit = a.keyed[key] // 0 for a value it does not know: every call refused
		}
		b := a.buckets[key]
		if b == nil {
			b = &bucket{tokens: a.burst(limit), last: now} // full at the start
			a.buckets[key] = b
		}
		b.tokens = math.Min(a.burst(limit), b.tokens+now.Sub(b.last).Seconds()*float64(limit))
		b.last = now
		if allowed = b.tokens >= 1; allowed {
			b.tokens--
		}
		a.calls = append(a.calls, Call{At: now.Sub(a.start), OK: allowed, Key: key})
		if allowed {
			a.ok[r.URL.Path]++
		}
	}
	a.mu.Unlock()
	if a.state && limit > 0 {
		w.Header().Set("RateLimit-Policy", fmt.Sprintf(`"default";q=%d;w=1`, limit))
		w.Header().Set("X-RateLimit-Limit", strconv.Itoa(limit))
	}
	if !allowed {
		w.Header().Set("Retry-After", "1")
		w.WriteHeader(http.StatusTooManyRequests)
	}
}

// Calls returns the calls answered since Start, in order, how many paths
// got through more than once, and how many got through.
func (a *API) Calls() (calls []Call, twice, through int) {
	a.mu.Lock()
	defer a.mu.Unlock()
	for _, n := range a.ok {
		if n > 1 {
			twice++
		}
	}
	return append([]Call(nil), a.calls...), twice, len(a.ok)
}

// Fleet is what runs against the API: Workers processes of the worker
// binary Worker on Redis at Redis, draining Tasks http:request tasks
// queued up front in Queue (a name of the run's own), whose type draws on
// one quota written as Quota (a YAML flow mapping). Dir holds the config
// and the workers' logs.
type Fleet struct {
	Worker  string
	Redis   string
	Dir     string
	Queue   string
	Quota   string
	Workers int
	Tasks   int
	// KillAt, if > 0: the first worker is killed with SIGKILL this long
	// after the first phase began, and started again at once.
	KillAt time.Duration
	// KeyTasks, if set, queues that many tasks per key value (KeyHeader),
	// interleaved in proportion, instead of Tasks without one: for a keyed
	// API, and a quota keyed by payload.headers["X-Dest"].
	KeyTasks map[string]int
}

// Result is what a run saw.
type Result struct {
	Calls []Call
	// Twice is how many tasks got through to the API more than once.
	Twice int
	// Restarted is the learned rate the restarted worker showed (its
	// sluice_adaptive_rate) when its metrics first answered, or -1;
	// FleetRate the fleet's learned rate in Redis just before it started
	// and just after that (jobs.LearnedRates), lower first.
	Restarted float64
	FleetRate [2]float64
	// Final is the learned rate the first worker showed at the end, or -1.
	Final float64
	// Archived, Failed: asynq's counts for the queue at the end;
	// Unaccounted: tasks queued that are in none of its lists and never got
	// through to the API.
	Archived, Failed, Unaccounted int
}

// Run runs f against api until the phases are over.
func (f Fleet) Run(ctx context.Context, api *API, phases []Phase) (Result, error) {
	res := Result{Restarted: -1, Final: -1}
	quota := "api-" + f.Queue
	config := filepath.Join(f.Dir, f.Queue+".yaml")
	yaml := fmt.Sprintf("redis: {addr: %q}\nqueues:\n  %s: {}\nquotas:\n  %s: %s\ntasks:\n  %s: {quotas: [%s]}\nhttp: {allow: ['%s']}\n",
		f.Redis, f.Queue, quota, f.Quota, jobs.TypeHTTPRequest, quota, api.Listener.Addr())
	if err := os.WriteFile(config, []byte(yaml), 0o644); err != nil {
		return res, err
	}
	opt := asynq.RedisClientOpt{Addr: f.Redis}
	keys := interleaved(f.KeyTasks)
	if keys == nil {
		keys = make([]string, f.Tasks)
	}
	f.Tasks = len(keys)
	if err := enqueue(opt, f.Queue, keys, api.URL); err != nil {
		return res, err
	}
	var total time.Duration
	for _, p := range phases {
		total += p.For
	}
	workers := make([]*process, f.Workers)
	defer func() {
		for _, w := range workers {
			if w != nil {
				w.stop()
			}
		}
	}()
	start := api.Start()
	for i := range workers {
		w, err := f.start(ctx, config, i)
		if err != nil {
			return res, err
		}
		workers[i] = w
	}
	if f.KillAt > 0 {
		select {
		case <-ctx.Done():
			return res, ctx.Err()
		case <-time.After(f.KillAt):
		}
		workers[0].cmd.Process.Kill()
		workers[0].wait()
		before, err := fleetRate(ctx, f.Redis, quota)
		if err != nil {
			return res, err
		}
		w, err := f.start(ctx, config, 0)
		if err != nil {
			return res, err
		}
		workers[0] = w
		res.Restarted = w.learnedRate(quota)
		after, err := fleetRate(ctx, f.Redis, quota)
		if err != nil {
			return res, err
		}
		res.FleetRate = [2]float64{min(before, after), max(before, after)}
	}
	select {
	case <-ctx.Done():
		return res, ctx.Err()
	case <-time.After(time.Until(start.Add(total))):
	}
	res.Final = workers[0].learnedRate(quota)
	for _, w := range workers {
		w.stop()
	}
	var done int
	res.Calls, res.Twice, done = api.Calls()
	inspector := asynq.NewInspector(opt)
	defer inspector.Close()
	info, err := inspector.GetQueueInfo(f.Queue)
	if err != nil {
		return res, err
	}
	res.Archived, res.Failed = info.Archived, info.FailedTotal
	res.Unaccounted = f.Tasks - done - info.Pending - info.Scheduled - info.Retry - info.Active - info.Archived
	return res, nil
}

// process is one worker process.
type process struct {
	cmd     *exec.Cmd
	metrics string
	done    chan struct{}
}

func (f Fleet) start(ctx context.Context, config string, i int) (*process, error) {
	port, release, err := testkit.ReservePort()
	if err != nil {
		return nil, fmt.Errorf("hiddenlimit: %w", err)
	}
	metrics := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
	log, err := os.OpenFile(filepath.Join(f.Dir, fmt.Sprintf("%s-worker-%d.log", f.Queue, i)), os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		release()
		return nil, err
	}
	p := &process{cmd: exec.CommandContext(ctx, f.Worker, "--config", config), metrics: metrics, done: make(chan struct{})}
	p.cmd.Env = append(os.Environ(), "SLUICE_WORKER_METRICS_ADDR="+metrics)
	p.cmd.Stdout, p.cmd.Stderr = log, log
	if err := p.cmd.Start(); err != nil {
		log.Close()
		release()
		return nil, err
	}
	go func() {
		p.cmd.Wait()
		log.Close()
		release()
		close(p.done)
	}()
	return p, nil
}

func (p *process) wait() { <-p.done }

func (p *process) stop() {
	select {
	case <-p.done:
		return
	default:
	}
	p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(15 * time.Second):
		p.cmd.Process.Kill()
		<-p.done
	}
}

// learnedRate waits up to 10 s for the worker's metrics and returns its
// sluice_adaptive_rate for quota, or -1.
func (p *process) learnedRate(quota string) float64 {
	prefix := `sluice_adaptive_rate{quota="` + quota + `"} `
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		resp, err := http.Get("http://" + p.metrics + "/metrics")
		if err != nil {
			continue
		}
		body, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
		resp.Body.Close()
		if err != nil {
			continue
		}
		for line := range strings.Lines(string(body)) {
			if v, ok := strings.CutPrefix(strings.TrimSpace(line), prefix); ok {
				if rate, err := strconv.ParseFloat(v, 64); err == nil {
					return rate
				}
			}
		}
	}
	return -1
}

// fleetRate is quota's learned rate in Redis, as enqueue status reads it
// (0 if none yet).
func fleetRate(ctx context.Context, addr, quota string) (float64, error) {
	rdb := redis.NewClient(&redis.Options{Addr: addr})
	defer rdb.Close()
	cfg := jobs.Config{Quotas: map[string]jobs.LimitConfig{quota: {Adaptive: &jobs.AdaptiveConfig{}}}}
	_, rates, err := jobs.LearnedRates(ctx, rdb, cfg, nil, time.Now())
	return rates[quota].Rate, err
}

// enqueue queues an http:request task calling url/call/<i> for each of
// keys, with its key value in KeyHeader unless it is "".
func enqueue(opt asynq.RedisClientOpt, queue string, keys []string, url string) error {
	client := asynq.NewClient(opt)
	defer client.Close()
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for w := range 8 {
		wg.Go(func() {
			for i := w; i < len(keys); i += 8 {
				p := jobs.HTTPRequestPayload{URL: fmt.Sprintf("%s/call/%d", url, i)}
				if keys[i] != "" {
					p.Headers = map[string]string{KeyHeader: keys[i]}
				}
				t, err := jobs.NewHTTPRequestTask(p)
				if err == nil {
					_, err = client.Enqueue(t, asynq.Queue(queue), asynq.MaxRetry(25))
				}
				if err != nil {
					errs <- err
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	return <-errs
}

// interleaved lists counts' key values, each as often as it says, spread
// evenly: the i-th of a value's n at i/n of the way; nil if counts is.
func interleaved(counts map[string]int) []string {
	if counts == nil {
		return nil
	}
	type slot struct {
		key string
		at  float64
	}
	var slots []slot
	for key, n := range counts {
		for i := range n {
			slots = append(slots, slot{key, (float64(i) + 0.5) / float64(n)})
		}
	}
	slices.SortFunc(slots, func(a, b slot) int {
		if c := cmp.Compare(a.at, b.at); c != 0 {
			return c
		}
		return strings.Compare(a.key, b.key)
	})
	keys := make([]string, len(slots))
	for i, s := range slots {
		keys[i] = s.key
	}
	return keys
}

// PhaseStats is what one phase saw: over the whole phase, and over the
// phase after its first Settle.
type PhaseStats struct {
	Limit        int
	Calls, Busy  int
	OKPerSecond  float64 // successes a second over the phase
	Settled      float64 // successes a second after Settle
	SettledShare float64 // Settled / Limit
}

// Stats splits calls by phase.
func Stats(calls []Call, phases []Phase, settle time.Duration) []PhaseStats {
	var out []PhaseStats
	var from time.Duration
	for _, p := range phases {
		s := PhaseStats{Limit: p.Limit}
		settledOK := 0
		for _, c := range calls {
			if c.At < from || c.At >= from+p.For {
				continue
			}
			s.Calls++
			if !c.OK {
				s.Busy++
				continue
			}
			if c.At >= from+settle {
				settledOK++
			}
		}
		s.OKPerSecond = float64(s.Calls-s.Busy) / p.For.Seconds()
		s.Settled = float64(settledOK) / (p.For - settle).Seconds()
		s.SettledShare = s.Settled / float64(p.Limit)
		out = append(out, s)
		from += p.For
	}
	return out
}

// BusyEnd is how long after at the 429s that began by then ended: the time
// of the last 429 before the first second without one, measured from at;
// 0 if there was none within a second of at.
func BusyEnd(calls []Call, at time.Duration) time.Duration {
	last := at
	for _, c := range calls {
		if c.At < at || c.OK {
			continue
		}
		if c.At-last >= time.Second {
			break
		}
		last = c.At
	}
	return last - at
}

// KeyStats is what one key value saw on a keyed API: calls, 429s, and
// successes a second after Settle.
type KeyStats struct {
	Key          string
	Limit        int
	Calls, Busy  int
	Settled      float64
	SettledShare float64 // Settled / Limit
}

// StatsByKey splits calls by key value, over a run of d, sorted by limit.
func StatsByKey(calls []Call, limits map[string]int, d, settle time.Duration) []KeyStats {
	byKey := map[string]*KeyStats{}
	for key, limit := range limits {
		byKey[key] = &KeyStats{Key: key, Limit: limit}
	}
	for _, c := range calls {
		s := byKey[c.Key]
		if s == nil || c.At >= d {
			continue
		}
		s.Calls++
		switch {
		case !c.OK:
			s.Busy++
		case c.At >= settle:
			s.Settled++
		}
	}
	out := make([]KeyStats, 0, len(byKey))
	for _, s := range byKey {
		s.Settled /= (d - settle).Seconds()
		s.SettledShare = s.Settled / float64(s.Limit)
		out = append(out, *s)
	}
	slices.SortFunc(out, func(a, b KeyStats) int { return cmp.Or(cmp.Compare(a.Limit, b.Limit), strings.Compare(a.Key, b.Key)) })
	return out
}
