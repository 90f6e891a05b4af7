package jobs

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// A runtime limit is an operator's override of a gate's limit from the
// config file, set live (enqueue limits set, PUT /v1/limits/{gate}) and
// kept in Redis: every worker merges the overrides in force onto its file's
// config (Config.WithRuntimeLimits) and applies the result as it applies a
// changed file, so turns booked at the old rate are booked again. An
// override holds until it is reset or its Until passes. Every change is
// recorded, newest first, in a bounded history.
//
// Redis keys: one hash of the overrides in force (field: the gate and the
// key value, value: the override as JSON), the history list, and a channel
// that tells the workers to read the hash again. The hash and the history
// share a hash tag, so one MULTI changes both, on Redis Cluster too.
const (
	runtimeLimitsKey = "sluice:{limits}:runtime"
	limitsHistoryKey = "sluice:{limits}:history"
	// limitsVersionKey counts the changes: a worker that missed a message
	// sees it change within limitsReread.
	limitsVersionKey = "sluice:{limits}:version"
	// limitsChangedNotice is published on blockChannel after every change:
	// workers hear it on the block board's subscription (blocks.go). No
	// block's announcement reads so: those have a space.
	limitsChangedNotice = "limits-changed"
)

// Bounds on what operators keep in Redis.
const (
	// maxRuntimeLimits bounds the overrides in force, all gates together
	// (a gate's key overrides are bounded by maxKeyOverrides too).
	maxRuntimeLimits = maxKeyOverrides
	// maxLimitsHistory is how many changes the history keeps.
	maxLimitsHistory = 10_000
	maxReason        = 500 // bytes of a change's reason
	maxBy            = 100 // bytes of who made it
	// maxOverrideFor bounds --for: an override meant to last longer than
	// a year belongs in the config file.
	maxOverrideFor = 366 * 24 * time.Hour
	// maxOverridePeriod bounds --period as throttle bounds a spec's.
	maxOverridePeriod = 24 * time.Hour
)

// LimitChange is what an operator asks to set on a gate (a queue's drain,
// "drain:emails", or a quota, "quota:crm"), or on one key value of a
// keyed gate: the fields given replace the file's, the others are kept.
type LimitChange struct {
	Gate      GateName
	Key       string // one key value of a keyed gate; "" for the gate itself
	Algorithm string
	Limit     int
	Period    time.Duration
	Burst     int
	For       time.Duration // the override lapses this long after it is set; 0: until reset
	By        string        // who: the operator's name
	Reason    string        // why, for the history; required
}

// RuntimeLimit is an override in force: the change, and when it was set
// and lapses, on the limits' Redis clock.
type RuntimeLimit struct {
	Gate      GateName      `json:"gate"`
	Key       string        `json:"key,omitempty"`
	Algorithm string        `json:"algorithm,omitempty"`
	Limit     int           `json:"limit,omitempty"`
	Period    time.Duration `json:"period_ns,omitempty"`
	Burst     int           `json:"burst,omitempty"`
	Until     time.Time     `json:"until,omitzero"` // zero: until reset
	By        string        `json:"by"`
	Reason    string        `json:"reason"`
	At        time.Time     `json:"at"`
}

// LimitEvent is one change in the history: a set, a reset, an import (of
// Count overrides at once) or an override that lapsed.
type LimitEvent struct {
	Action string        `json:"action"` // "set", "reset", "import", "lapse"
	Gate   GateName      `json:"gate,omitzero"`
	Key    string        `json:"key,omitempty"`
	Set    *RuntimeLimit `json:"set,omitempty"` // what a set put in force
	Count  int           `json:"count,omitempty"`
	By     string        `json:"by"`
	Reason string        `json:"reason,omitempty"`
	At     time.Time     `json:"at"`
}

// LimitChangeError is a change refused, naming the field at fault as the
// CLI's flags and the HTTP API's JSON name it ("limit", "key", "gate").
type LimitChangeError struct {
	Field   string
	Problem string
}

func (e *LimitChangeError) Error() string { return e.Field + ": " + e.Problem }

func changeProblem(field, format string, args ...any) error {
	return &LimitChangeError{Field: field, Problem: fmt.Sprintf(format, args...)}
}

// MarshalText and UnmarshalText write and read a gate's name as String
// and ParseGateName do.
func (g GateName) MarshalText() ([]byte, error) { return []byte(g.String()), nil }

func (g *GateName) UnmarshalText(b []byte) error {
	parsed, err := ParseGateName(string(b))
	*g = parsed
	return err
}

// LimitGates lists the gates of c whose limits can be set live, sorted:
// every queue's drain and every quota.
func LimitGates(c Config) []GateName {
	var gates []GateName
	for _, q := range sortedKeys(c.Queues) {
		if c.Queues[q].Drain != nil {
			gates = append(gates, GateName{DrainGate, q})
		}
	}
	for _, name := range sortedKeys(c.Quotas) {
		gates = append(gates, GateName{QuotaGate, name})
	}
	return gates
}

// limitOf is the file's limit of gate in c, or nil if c has no such gate.
func (c Config) limitOf(gate GateName) *LimitConfig {
	switch gate.Kind {
	case DrainGate:
		if q, ok := c.Queues[gate.Name]; ok && q.Drain != nil {
			d := *q.Drain
			return &d
		}
	case QuotaGate:
		if l, ok := c.Quotas[gate.Name]; ok {
			return &l
		}
	}
	return nil
}

// check refuses a change that is malformed or names what file does not
// have. It does not judge the limit the change makes: the merged config's
// Validate does.
func (ch LimitChange) check(file Config, resetting bool) error {
	l := file.limitOf(ch.Gate)
	if l == nil {
		known := make([]string, 0)
		for _, g := range LimitGates(file) {
			known = append(known, g.String())
		}
		return changeProblem("gate", "%s is not a gate of the config; the gates are: %s", ch.Gate, strings.Join(known, ", "))
	}
	switch {
	case ch.Key != "" && l.Key == "":
		return changeProblem("key", "%s is not keyed: it has one limit for every task; leave out the key", ch.Gate)
	case len(ch.Key) > maxKeyName:
		return changeProblem("key", "a key value is at most %d bytes, got %d", maxKeyName, len(ch.Key))
	case strings.TrimSpace(ch.Reason) == "":
		return changeProblem("reason", "say why (it is kept in the history)")
	case len(ch.Reason) > maxReason:
		return changeProblem("reason", "at most %d bytes, got %d", maxReason, len(ch.Reason))
	case strings.TrimSpace(ch.By) == "":
		return changeProblem("by", "say who makes the change")
	case len(ch.By) > maxBy:
		return changeProblem("by", "at most %d bytes, got %d", maxBy, len(ch.By))
	}
	if resetting {
		return nil
	}
	switch {
	case ch.Algorithm == "" && ch.Limit == 0 && ch.Period == 0 && ch.Burst == 0:
		return changeProblem("limit", "give at least one of limit, period, burst and algorithm")
	case ch.Limit < 0:
		return changeProblem("limit", "must be >= 1, got %d", ch.Limit)
	case ch.Period < 0 || ch.Period > maxOverridePeriod:
		return changeProblem("period", "must be between 1µs and %v, got %v", maxOverridePeriod, ch.Period)
	case ch.Burst < 0:
		return changeProblem("burst", "must be >= 1, got %d", ch.Burst)
	case ch.For < 0 || ch.For > maxOverrideFor:
		return changeProblem("for", "must be between 1s and %v, got %v", maxOverrideFor, ch.For)
	case ch.For > 0 && ch.For < time.Second:
		return changeProblem("for", "must be at least 1s, got %v", ch.For)
	}
	return nil
}

// storedKey is key value v of gate as the runtime limits keep it: as its
// limit keeps it (hashed with hash_keys, so that a token set live is in
// no Redis key, field or history entry either).
func (c Config) storedKey(gate GateName, v string) string {
	if l := c.limitOf(gate); l != nil && v != "" {
		return l.storedKey(v)
	}
	return v
}

// field is the hash field of an override of gate (and key value).
func runtimeField(gate GateName, key string) string { return gate.String() + "\x00" + key }

// WithRuntimeLimits returns c with the overrides of rl in force at now
// merged in: a gate's replaces the fields it sets of the gate's limit, a
// key value's those of the value's override (the file's, if it has one).
// Every gate rl changed (set, reset or lapsed, for the gate or a key
// value) is in the generation of its latest change: its state is new (see
// LimitConfig.stateVersion). Entries for gates c does not have are left
// out. c is not changed.
func (c Config) WithRuntimeLimits(rl []RuntimeLimit, now time.Time) Config {
	if len(rl) == 0 {
		return c
	}
	c.Queues = maps.Clone(c.Queues)
	c.Quotas = maps.Clone(c.Quotas)
	copied := map[GateName]bool{} // gates whose Overrides map is c's own
	generation := map[GateName]time.Time{}
	for _, r := range rl {
		l := c.limitOf(r.Gate)
		if l == nil || (r.Key != "" && l.Key == "") {
			continue
		}
		changed := r.At
		if r.lapsed(now) {
			changed = r.Until
		}
		if changed.After(generation[r.Gate]) {
			generation[r.Gate] = changed
		}
		if r.lapsed(now) || !r.sets() {
			continue
		}
		o := LimitOverride{Algorithm: r.Algorithm, Limit: r.Limit, Period: r.Period, Burst: r.Burst}
		if r.Key == "" {
			*l = l.replaced(o)
		} else {
			if !copied[r.Gate] {
				l.Overrides = maps.Clone(l.Overrides)
				if l.Overrides == nil {
					l.Overrides = map[string]LimitOverride{}
				}
				copied[r.Gate] = true
			}
			stored := l.storedKey(r.Key)
			l.Overrides[stored] = l.Overrides[stored].merged(o)
		}
		c.setLimit(r.Gate, *l)
	}
	for gate, at := range generation {
		l := c.limitOf(gate)
		l.generation = at.UnixMicro()
		c.setLimit(gate, *l)
	}
	return c
}

// setLimit puts l in c as gate's limit; c's maps must be its own.
func (c Config) setLimit(gate GateName, l LimitConfig) {
	if gate.Kind == DrainGate {
		q := c.Queues[gate.Name]
		q.Drain = &l
		c.Queues[gate.Name] = q
		return
	}
	c.Quotas[gate.Name] = l
}

func (r RuntimeLimit) lapsed(now time.Time) bool { return !r.Until.IsZero() && !now.Before(r.Until) }

// sets reports whether r overrides anything. One that does not is the mark
// a reset or a lapse leaves, kept for its time (the gate's generation)
// for keepMarks.
func (r RuntimeLimit) sets() bool {
	return r.Algorithm != "" || r.Limit != 0 || r.Period != 0 || r.Burst != 0
}

// InForce reports whether r overrides a limit at now.
func (r RuntimeLimit) InForce(now time.Time) bool { return r.sets() && !r.lapsed(now) }

// mark is what r leaves when it is reset at (or lapses: at its Until).
func (r RuntimeLimit) mark(at time.Time) RuntimeLimit {
	return RuntimeLimit{Gate: r.Gate, Key: r.Key, By: r.By, Reason: r.Reason, At: at}
}

// keepMarks is how long the mark of a reset or lapse is kept: longer than
// any turn is booked ahead (maxReserve), so that no worker goes back to
// a state whose turns were given up.
const keepMarks = maxReserve + time.Hour

// nextLapse is the earliest Until after now among rl, or the zero Time.
func nextLapse(rl []RuntimeLimit, now time.Time) time.Time {
	var next time.Time
	for _, r := range rl {
		if r.Until.After(now) && (next.IsZero() || r.Until.Before(next)) {
			next = r.Until
		}
	}
	return next
}

// InForce is file with the runtime limits in force at now merged in: the
// config the workers run, and whose gates' state a reader must look at.
func InForce(ctx context.Context, rdb redis.UniversalClient, file Config, now time.Time) (Config, error) {
	rl, err := LoadRuntimeLimits(ctx, rdb)
	if err != nil {
		return file, err
	}
	return file.WithRuntimeLimits(rl, now), nil
}

// LoadRuntimeLimits reads the overrides kept in Redis, lapsed ones
// included (WithRuntimeLimits leaves those out), sorted by gate and key.
func LoadRuntimeLimits(ctx context.Context, rdb redis.UniversalClient) ([]RuntimeLimit, error) {
	all, err := rdb.HGetAll(ctx, runtimeLimitsKey).Result()
	if err != nil {
		return nil, fmt.Errorf("jobs: reading the runtime limits: %w", err)
	}
	return decodeRuntimeLimits(all)
}

func decodeRuntimeLimits(fields map[string]string) ([]RuntimeLimit, error) {
	rl := make([]RuntimeLimit, 0, len(fields))
	for field, v := range fields {
		var r RuntimeLimit
		if err := json.Unmarshal([]byte(v), &r); err != nil {
			return nil, fmt.Errorf("jobs: the runtime limit %q in Redis does not read: %w", strings.ReplaceAll(field, "\x00", " "), err)
		}
		rl = append(rl, r)
	}
	slices.SortFunc(rl, func(a, b RuntimeLimit) int {
		return strings.Compare(runtimeField(a.Gate, a.Key), runtimeField(b.Gate, b.Key))
	})
	return rl, nil
}

// SetLimit puts ch in force on every worker of the fleet that runs file,
// records it in the history and returns it as kept. A change that is
// malformed, names no gate of file or makes a limit that file's checks
// refuse is a *LimitChangeError, and nothing is written.
func SetLimit(ctx context.Context, rdb redis.UniversalClient, file Config, ch LimitChange) (RuntimeLimit, error) {
	if err := ch.check(file, false); err != nil {
		return RuntimeLimit{}, err
	}
	return setLimits(ctx, rdb, file, []LimitChange{ch}, "set", ch.By, ch.Reason)
}

// ImportLimits puts every change of chs in force at once, all or nothing,
// recorded as one import in the history. A bad change is refused naming
// its place in chs ("3: limit: ...") and nothing is written.
func ImportLimits(ctx context.Context, rdb redis.UniversalClient, file Config, chs []LimitChange, by, reason string) error {
	if len(chs) == 0 {
		return changeProblem("file", "holds no override")
	}
	for i := range chs {
		chs[i].By, chs[i].Reason = by, reason
		if err := chs[i].check(file, false); err != nil {
			return fmt.Errorf("%d: %w", i+1, err)
		}
	}
	_, err := setLimits(ctx, rdb, file, chs, "import", by, reason)
	return err
}

// setLimits validates file with chs merged onto the overrides in force,
// then writes chs and the history's entry in one MULTI, and tells the
// fleet.
func setLimits(ctx context.Context, rdb redis.UniversalClient, file Config, chs []LimitChange, action, by, reason string) (RuntimeLimit, error) {
	now, err := rdb.Time(ctx).Result()
	if err != nil {
		return RuntimeLimit{}, fmt.Errorf("jobs: reading Redis's clock: %w", err)
	}
	kept, err := LoadRuntimeLimits(ctx, rdb)
	if err != nil {
		return RuntimeLimit{}, err
	}
	byField := make(map[string]RuntimeLimit, len(kept)+len(chs))
	w := limitsWrite{queues: sortedKeys(file.Queues)}
	for _, r := range kept {
		if r, ok := w.sweep(r, now); ok {
			byField[runtimeField(r.Gate, r.Key)] = r
		}
	}
	set := make([]RuntimeLimit, len(chs))
	for i, ch := range chs {
		r := RuntimeLimit{Gate: ch.Gate, Key: file.storedKey(ch.Gate, ch.Key), Algorithm: ch.Algorithm, Limit: ch.Limit, Period: ch.Period, Burst: ch.Burst, By: ch.By, Reason: ch.Reason, At: now}
		if ch.For > 0 {
			r.Until = now.Add(ch.For)
		}
		set[i] = r
		byField[runtimeField(r.Gate, r.Key)] = r
	}
	if len(byField) > maxRuntimeLimits {
		return RuntimeLimit{}, changeProblem("key", "at most %d runtime limits may be kept (those reset or lapsed for a day after), this would make %d; put plan tiers in the config's overrides", maxRuntimeLimits, len(byField))
	}
	merged := file.Defaults().WithRuntimeLimits(slices.Collect(maps.Values(byField)), now)
	if err := refusal(merged.Validate(), chs[0]); err != nil {
		return RuntimeLimit{}, err
	}
	event := LimitEvent{Action: action, By: by, Reason: reason, At: now}
	if action == "import" {
		event.Count = len(set)
		if uniform := !slices.ContainsFunc(set, func(r RuntimeLimit) bool { return r.Gate != set[0].Gate }); uniform {
			event.Gate = set[0].Gate
		}
	} else {
		event.Gate, event.Key, event.Set = set[0].Gate, set[0].Key, &set[0]
	}
	w.put = append(w.put, set...)
	w.history = append(w.history, event)
	return set[0], w.do(ctx, rdb)
}

// refusal turns the first of a merged config's problems into a
// *LimitChangeError naming the field at fault: the one the problem's key
// ends in, if a change sets it, or else the first field that ch sets (a
// burst lowered below a task's cost is a problem of tasks.<type>.cost).
func refusal(problems []error, ch LimitChange) error {
	if len(problems) == 0 {
		return nil
	}
	problem := problems[0].Error()
	var p *ConfigProblem
	if errors.As(problems[0], &p) {
		switch field := p.Key[strings.LastIndexByte(p.Key, '.')+1:]; field {
		case "limit", "period", "burst", "algorithm":
			return changeProblem(field, "%s (%s)", p.Problem, p.Key)
		}
	}
	field := "limit"
	switch {
	case ch.Burst != 0:
		field = "burst"
	case ch.Limit != 0:
	case ch.Period != 0:
		field = "period"
	case ch.Algorithm != "":
		field = "algorithm"
	}
	return changeProblem(field, "the config would be refused with it: %s", problem)
}

// ResetLimit takes away the override of gate (or of one key value of it):
// the file's limit is in force again. It reports whether there was one; if
// not, nothing is written.
func ResetLimit(ctx context.Context, rdb redis.UniversalClient, file Config, gate GateName, key, by, reason string) (bool, error) {
	ch := LimitChange{Gate: gate, Key: key, By: by, Reason: reason}
	if err := ch.check(file, true); err != nil {
		return false, err
	}
	key = file.storedKey(gate, key)
	now, err := rdb.Time(ctx).Result()
	if err != nil {
		return false, fmt.Errorf("jobs: reading Redis's clock: %w", err)
	}
	v, err := rdb.HGet(ctx, runtimeLimitsKey, runtimeField(gate, key)).Result()
	if errors.Is(err, redis.Nil) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("jobs: reading the runtime limit: %w", err)
	}
	var r RuntimeLimit
	if err := json.Unmarshal([]byte(v), &r); err != nil {
		return false, fmt.Errorf("jobs: the runtime limit of %s%s in Redis does not read: %w", gate, key, err)
	}
	w := limitsWrite{queues: sortedKeys(file.Queues)}
	if _, ok := w.sweep(r, now); !ok || !r.InForce(now) {
		return false, w.do(ctx, rdb) // lapsed (its lapse is recorded now), or reset before
	}
	w.put = append(w.put, RuntimeLimit{Gate: gate, Key: key, By: by, Reason: reason}.mark(now))
	w.history = append(w.history, LimitEvent{Action: "reset", Gate: gate, Key: key, By: by, Reason: reason, At: now})
	return true, w.do(ctx, rdb)
}

// writeChunk is how many overrides one HSET writes.
const writeChunk = 1000

// limitsWrite is one change of the runtime limits: entries to put, to
// drop, and the history's events, written in one MULTI.
type limitsWrite struct {
	put     []RuntimeLimit
	drop    []RuntimeLimit
	history []LimitEvent
	// queues are the fleet's queues: their tasks waiting in Redis for
	// turns booked before the change are brought forward to book again.
	// The workers running do it too when they put the change in force; this
	// is for a fleet with none running, whose next worker would otherwise
	// see them back only at their old turns.
	queues []string
}

// sweep notes what r, kept in Redis, has become at now: a lapsed override
// is replaced by its mark, and its lapse recorded; a mark older than
// keepMarks is dropped (ok false). It returns r as it is now.
func (w *limitsWrite) sweep(r RuntimeLimit, now time.Time) (_ RuntimeLimit, ok bool) {
	switch {
	case r.sets() && r.lapsed(now):
		m := r.mark(r.Until)
		w.put = append(w.put, m)
		w.history = append(w.history, LimitEvent{Action: "lapse", Gate: r.Gate, Key: r.Key, By: r.By, Reason: r.Reason, At: r.Until})
		return m, true
	case !r.sets() && now.Sub(r.At) > keepMarks:
		w.drop = append(w.drop, r)
		return r, false
	}
	return r, true
}

// do writes w, then tells the fleet.
func (w *limitsWrite) do(ctx context.Context, rdb redis.UniversalClient) error {
	if len(w.put) == 0 && len(w.drop) == 0 {
		return nil
	}
	history := make([]any, len(w.history))
	for i, e := range w.history {
		history[i] = mustJSON(e)
	}
	_, err := rdb.TxPipelined(ctx, func(p redis.Pipeliner) error {
		for _, r := range w.drop {
			p.HDel(ctx, runtimeLimitsKey, runtimeField(r.Gate, r.Key))
		}
		// Put after the drops and in order: a set replaces the mark its
		// gate's lapse left a moment before.
		for chunk := range slices.Chunk(w.put, writeChunk) {
			pairs := make([]any, 0, 2*len(chunk))
			for _, r := range chunk {
				pairs = append(pairs, runtimeField(r.Gate, r.Key), mustJSON(r))
			}
			p.HSet(ctx, runtimeLimitsKey, pairs...)
		}
		p.Incr(ctx, limitsVersionKey)
		if len(history) > 0 {
			p.LPush(ctx, limitsHistoryKey, history...)
			p.LTrim(ctx, limitsHistoryKey, 0, maxLimitsHistory-1)
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("jobs: writing the runtime limits (nothing was changed): %w", err)
	}
	if err := rdb.Publish(ctx, blockChannel, limitsChangedNotice).Err(); err != nil {
		// Written, but not announced: workers read the overrides again
		// when they next subscribe, and every limitsReread.
		return fmt.Errorf("jobs: the change is written, but telling the workers failed (they read it within %v): %w", limitsReread, err)
	}
	for _, queue := range w.queues {
		if err := wakeScript.Run(ctx, rdb, wakeKeys(queue), "", "rush").Err(); err != nil {
			return fmt.Errorf("jobs: the change is in force, but bringing forward the tasks of queue %q booked before it failed (a running worker does it too): %w", queue, err)
		}
	}
	return nil
}

func mustJSON(v any) string {
	b, err := json.Marshal(v)
	if err != nil {
		panic(err) // every value given is plain data
	}
	return string(b)
}

// LimitHistory returns up to n changes, newest first, of gate (every
// gate's if gate is the zero GateName).
func LimitHistory(ctx context.Context, rdb redis.UniversalClient, gate GateName, n int) ([]LimitEvent, error) {
	raw, err := rdb.LRange(ctx, limitsHistoryKey, 0, maxLimitsHistory-1).Result()
	if err != nil {
		return nil, fmt.Errorf("jobs: reading the history of the limits: %w", err)
	}
	events := make([]LimitEvent, 0, min(n, len(raw)))
	for _, v := range raw {
		if len(events) == n {
			break
		}
		var e LimitEvent
		if err := json.Unmarshal([]byte(v), &e); err != nil {
			return nil, fmt.Errorf("jobs: an entry of the history of the limits does not read: %w", err)
		}
		if gate == (GateName{}) || e.Gate == gate {
			events = append(events, e)
		}
	}
	return events, nil
}

// limitsReread is how often a worker asks whether the runtime limits
// changed (one GET), in case it missed the channel's message.
const limitsReread = 10 * time.Second

// limitsWatch keeps this worker's runtime limits those in Redis: it reads
// them again when the fleet is told of a change or the block board has
// subscribed again (poke), when the version moved since its last read
// (every limitsReread), and when an override lapses; and puts them in
// force with apply.
type limitsWatch struct {
	fleetDeps
	apply   func([]RuntimeLimit)
	changed chan struct{}
	version int64 // the version last read; -1: none read yet
	next    time.Time
}

func newLimitsWatch(deps fleetDeps, apply func([]RuntimeLimit)) *limitsWatch {
	return &limitsWatch{fleetDeps: deps, apply: apply, changed: make(chan struct{}, 1), version: -1}
}

// poke asks run to read the runtime limits again.
func (w *limitsWatch) poke() {
	select {
	case w.changed <- struct{}{}:
	default:
	}
}

func (w *limitsWatch) run(ctx context.Context) {
	reread := time.NewTicker(limitsReread)
	defer reread.Stop()
	lapse := time.NewTimer(time.Hour)
	defer lapse.Stop()
	for {
		lapse.Reset(time.Hour)
		if !w.next.IsZero() {
			lapse.Reset(max(0, w.next.Sub(w.clock.Now())))
		}
		select {
		case <-ctx.Done():
			return
		case <-w.changed:
		case <-lapse.C:
		case <-reread.C:
			v, err := w.rdb.Get(ctx, limitsVersionKey).Int64()
			if errors.Is(err, redis.Nil) {
				v, err = 0, nil
			}
			if err != nil || v == w.version {
				continue
			}
		}
		w.read(ctx)
	}
}

// read reads the runtime limits and puts them in force; on failure the
// ones in force stay, and the next reread tries again.
func (w *limitsWatch) read(ctx context.Context) {
	var version *redis.StringCmd
	var all *redis.MapStringStringCmd
	// One trip, no transaction: the version is read first, so a change
	// made between the two is read again at the next reread.
	_, err := w.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		version = p.Get(ctx, limitsVersionKey)
		all = p.HGetAll(ctx, runtimeLimitsKey)
		return nil
	})
	if err != nil && !errors.Is(err, redis.Nil) {
		if ctx.Err() == nil {
			w.log.Warn("cannot read the runtime limits; those in force stay", "err", err)
		}
		w.version = -1
		return
	}
	rl, err := decodeRuntimeLimits(all.Val())
	if err != nil {
		w.log.Error("the runtime limits in Redis do not read; those in force stay", "err", err)
		return
	}
	w.version, _ = version.Int64()
	w.next = nextLapse(rl, w.clock.Now())
	w.apply(rl)
}

// GateLimits is one gate as enqueue limits list and GET /v1/limits show
// it: its limit in the file, the one in force, and the override set live
// that made the difference.
type GateLimits struct {
	Gate     GateName      `json:"gate"`
	File     LimitSpec     `json:"file"`
	InForce  LimitSpec     `json:"in_force"`
	Override *RuntimeLimit `json:"override"` // null: the file's limit is in force
	// KeyOverrides counts the key values with an override in force; Keys
	// lists them when asked for.
	KeyOverrides int            `json:"key_overrides"`
	Keys         []RuntimeLimit `json:"keys,omitempty"`
}

// LimitSpec is a limit as a person reads it.
type LimitSpec struct {
	Algorithm string `json:"algorithm"`
	Limit     int    `json:"limit"`
	Period    string `json:"period"`
	Burst     int    `json:"burst,omitempty"`
	Key       string `json:"key,omitempty"` // a keyed limit's expression
}

func limitSpecOf(l LimitConfig) LimitSpec {
	return LimitSpec{Algorithm: l.Algorithm, Limit: l.Limit, Period: l.Period.String(), Burst: l.Burst, Key: l.Key}
}

func (l LimitSpec) String() string {
	s := fmt.Sprintf("%s %d/%s", l.Algorithm, l.Limit, l.Period)
	if l.Burst > 0 {
		s += fmt.Sprintf(" burst %d", l.Burst)
	}
	return s
}

// ListLimits returns every gate of file whose limit can be set live, with
// the overrides in force now (and with keys, every key value's).
func ListLimits(ctx context.Context, rdb redis.UniversalClient, file Config, keys bool) ([]GateLimits, error) {
	rl, err := LoadRuntimeLimits(ctx, rdb)
	if err != nil {
		return nil, err
	}
	now, err := rdb.Time(ctx).Result()
	if err != nil {
		return nil, fmt.Errorf("jobs: reading Redis's clock: %w", err)
	}
	file = file.Defaults()
	inForce := file.WithRuntimeLimits(rl, now).Defaults()
	gates := []GateLimits{}
	for _, gate := range LimitGates(file) {
		g := GateLimits{Gate: gate, File: limitSpecOf(*file.limitOf(gate)), InForce: limitSpecOf(*inForce.limitOf(gate))}
		for _, r := range rl {
			switch {
			case r.Gate != gate || !r.InForce(now):
			case r.Key == "":
				g.Override = &r
			default:
				g.KeyOverrides++
				if keys {
					g.Keys = append(g.Keys, r)
				}
			}
		}
		gates = append(gates, g)
	}
	return gates, nil
}

// LimitChangeJSON is a change as JSON writes it: a line of enqueue limits
// import, or the body of PUT /v1/limits/{gate} (whose gate is in its path).
// Durations are Go's ("1s", "30m").
type LimitChangeJSON struct {
	Gate      string `json:"gate,omitempty"`
	Key       string `json:"key,omitempty"`
	Algorithm string `json:"algorithm,omitempty"`
	Limit     int    `json:"limit,omitempty"`
	Period    string `json:"period,omitempty"`
	Burst     int    `json:"burst,omitempty"`
	For       string `json:"for,omitempty"`
	Reason    string `json:"reason,omitempty"`
	By        string `json:"by,omitempty"`
}

// Change reads j as a LimitChange of gate (j.Gate's if gate is the zero
// GateName); a field that does not read is a *LimitChangeError naming it.
func (j LimitChangeJSON) Change(gate GateName) (LimitChange, error) {
	if j.Gate != "" {
		parsed, err := ParseGateName(j.Gate)
		switch {
		case err != nil:
			return LimitChange{}, changeProblem("gate", "%v", err)
		case gate != (GateName{}) && parsed != gate:
			return LimitChange{}, changeProblem("gate", "%s differs from the gate changed, %s; leave it out", parsed, gate)
		}
		gate = parsed
	}
	if gate == (GateName{}) {
		return LimitChange{}, changeProblem("gate", "required: KIND:NAME, like drain:emails or quota:crm-api")
	}
	ch := LimitChange{Gate: gate, Key: j.Key, Algorithm: j.Algorithm, Limit: j.Limit, Burst: j.Burst, Reason: j.Reason, By: j.By}
	for _, d := range []struct {
		field, text string
		to          *time.Duration
	}{{"period", j.Period, &ch.Period}, {"for", j.For, &ch.For}} {
		if d.text == "" {
			continue
		}
		var err error
		if *d.to, err = time.ParseDuration(d.text); err != nil {
			return LimitChange{}, changeProblem(d.field, "%v", err)
		}
	}
	return ch, nil
}
