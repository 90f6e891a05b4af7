package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"math"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
	"github.com/spf13/cobra"

	"github.com/sluicehq/sluice/jobs"
	"github.com/sluicehq/sluice/producer"
	"github.com/sluicehq/sluice/throttle"
)

func newStatusCommand(a *app) *cobra.Command {
	var watch, asJSON, tasks, shards bool
	var keys, key, queue string
	var top int
	cmd := &cobra.Command{
		Use:   "status [--watch] [--json] [--keys <gate> [--top N] | --queue Q --tasks [--top N]]",
		Short: "Show the queues, their gates and the live workers",
		Long: `Show every queue (those in the config and any other asynq knows) with its
task counts, its drain and the rate its tasks completed at over the last
minute; every quota with how many events it could admit now (a keyed one's
is per key: --keys); and the live workers, with the tasks each runs at once
(worker.concurrency) and may hold waiting (worker.waiting). WAITING counts
the tasks waiting in Redis for their turn: asynq, and asynqmon, hold them as
retries (or as scheduled copies), and RETRY and SCHEDULED here do not count
them (up to ` + fmt.Sprint(maxClassified) + ` of each set are read; "+" if there were more). --watch refreshes every second until Ctrl-C; --json prints one JSON
document (with --watch, one per line).

--keys <gate> shows instead the busiest key values of a keyed gate, named as
in the metrics' gate label: drain:<queue> or quota:<name> (a limit with
key:; a quota's bare name will do), fair:<queue> (a queue's fairness),
concurrency:type:<type> (concurrency_key). For each key: WAITING, the events
booked on it for turns still to come (a fair queue: and the tasks in the
key's line; "-" where the algorithm does not tell), THROTTLED, the events it
throttled in the last minute (counted in 10s steps), and whether it can admit
one now. The most throttled first, then the most waiting; --top of them
(default 20, at most ` + fmt.Sprint(jobs.MaxKeyLoads) + `). It scans the gate's keys in Redis (SCAN).
--key VALUE shows that key value's row only: a limit with hash_keys keeps
its values by their hashes (sha256:...), and --key hashes VALUE to find it.

--queue Q --tasks lists instead the queue's tasks that wait to start, soonest
first, each with its predicted start as "enqueue eta" tells it: those a
worker holds for their turn, those waiting in Redis for their booked turn
(or to ask again), and the first pending ones; --top of them (default 20, at
most ` + fmt.Sprint(jobs.MaxTaskETAs) + `).`,
		Args: func(cmd *cobra.Command, args []string) error {
			if len(args) > 0 {
				return badInput(fmt.Errorf("status takes no arguments, got %q", args))
			}
			if tasks != (queue != "") {
				return badInput(fmt.Errorf("--tasks and --queue Q go together"))
			}
			if tasks && keys != "" {
				return badInput(fmt.Errorf("--tasks and --keys show different things: give one"))
			}
			if queue != "" {
				if err := checkQueueFlag(queue); err != nil {
					return err
				}
			}
			if cmd.Flags().Changed("top") && keys == "" && !tasks {
				return badInput(fmt.Errorf("--top is for --keys <gate> or --tasks"))
			}
			if cmd.Flags().Changed("key") && (keys == "" || cmd.Flags().Changed("top")) {
				return badInput(fmt.Errorf("--key is for --keys <gate>, without --top"))
			}
			if top < 1 || top > jobs.MaxKeyLoads {
				return badInput(fmt.Errorf("--top must be from 1 to %d, got %d", jobs.MaxKeyLoads, top))
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			if tasks {
				return a.taskStatus(cmd, queue, top, watch, asJSON)
			}
			if keys != "" {
				return a.keyStatus(cmd, keys, top, cmd.Flags().Changed("key"), key, watch, asJSON)
			}
			return a.status(cmd, watch, asJSON, shards)
		},
	}
	cmd.Flags().BoolVar(&watch, "watch", false, "refresh every second until Ctrl-C")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	cmd.Flags().BoolVar(&shards, "shards", false, "list each shard of a sharded queue under its row (JSON lists them always)")
	cmd.Flags().StringVar(&keys, "keys", "", "show the busiest keys of this keyed gate (drain:<queue>, quota:<name>, fair:<queue>, concurrency:type:<type>)")
	cmd.Flags().IntVar(&top, "top", 20, "with --keys or --tasks: how many to show")
	cmd.Flags().StringVar(&queue, "queue", "", "with --tasks: the `queue` whose tasks to list")
	cmd.Flags().BoolVar(&tasks, "tasks", false, "list a queue's waiting tasks with their predicted starts (with --queue)")
	cmd.Flags().StringVar(&key, "key", "", "with --keys: show this key value only (hashed to find it where the limit has hash_keys)")
	return cmd
}

// snapshot is what status shows.
type snapshot struct {
	Time    time.Time      `json:"time"`
	Queues  []queueStatus  `json:"queues"`
	Quotas  []gateStatus   `json:"quotas"`
	Workers []workerStatus `json:"workers"`
}

type queueStatus struct {
	Name       string `json:"name"`
	Configured bool   `json:"configured"` // in config.yaml, so workers serve it
	Paused     bool   `json:"paused"`
	Pending    int    `json:"pending"`
	// Waiting are the tasks waiting in Redis for their turn, sent back by
	// a worker: asynq holds them as retries (or, those with no retry
	// left, as scheduled copies), counted apart here (jobs.WaitingTask).
	Waiting int `json:"waiting"`
	// WaitingAtLeast: the retry or scheduled set held more than
	// maxClassified tasks, and only that many were looked at: Waiting is a
	// lower bound.
	WaitingAtLeast bool        `json:"waiting_at_least,omitempty"`
	Scheduled      int         `json:"scheduled"` // by their producer
	Retry          int         `json:"retry"`     // after a failure
	Active         int         `json:"active"`
	Archived       int         `json:"archived"`
	Aggregating    int         `json:"aggregating"`
	Completed      int         `json:"completed"` // kept for their retention
	Drain          *gateStatus `json:"drain"`     // null: not rate-limited
	// RatePerSecond is the rate at which the fleet completed the queue's
	// tasks over the last minute.
	RatePerSecond float64 `json:"rate_per_second"`
	// Shards are a sharded queue's shards (queues.<q>.shards), each as a
	// queue (named as asynq names it) with Level, what its share of the
	// drain could admit now; the queue's row is their sum.
	Shards []queueStatus `json:"shards,omitempty"`
	Level  *int          `json:"level,omitempty"` // a shard's
}

// gateStatus is a drain or a quota as configured, and its level.
type gateStatus struct {
	Name      string `json:"name,omitempty"` // a quota's
	Algorithm string `json:"algorithm"`
	Limit     int    `json:"limit"`
	Period    string `json:"period"`
	Burst     int    `json:"burst,omitempty"` // the buckets' size
	// Level is how many events it could admit now; null for a keyed
	// limit, whose level is per key value (status --keys).
	Level    *int   `json:"level"`
	Capacity int    `json:"capacity"`      // the most it can admit at once
	Key      string `json:"key,omitempty"` // a keyed limit's key expression
	// Live: an override set live (enqueue limits set) is in force in
	// place of the file's limit; LiveKeys: so many key values have one.
	Live     bool `json:"live,omitempty"`
	LiveKeys int  `json:"live_keys,omitempty"`
	// Adaptive, for an adaptive quota: the rate the fleet learned (Limit
	// is it rounded, unless set live) and its bounds.
	Adaptive *adaptiveStatus `json:"adaptive,omitempty"`
}

type adaptiveStatus struct {
	Rate    *float64 `json:"rate"` // events per period; null: none learned yet (the start is in force)
	Per     string   `json:"per"`  // the period of Rate, the file's (a fraction is put in force over ten)
	Min     int      `json:"min"`
	Max     int      `json:"max"`
	Learned string   `json:"learned_at,omitempty"` // when its limit was last changed
}

type workerStatus struct {
	Host string `json:"host"`
	PID  int    `json:"pid"`
	// Concurrency is how many tasks it runs at once (worker.concurrency);
	// WaitingSlots how many more it may hold waiting for their turn
	// (worker.waiting). asynq counts both as its concurrency.
	Concurrency  int            `json:"concurrency"`
	WaitingSlots int            `json:"waiting_slots"`
	Active       int            `json:"active"` // tasks running or waiting in the worker now
	Queues       map[string]int `json:"queues"` // name -> priority
	Started      time.Time      `json:"started"`
	Status       string         `json:"status"`
}

// status prints one snapshot, or one a second with watch until ctx is done.
func (a *app) status(cmd *cobra.Command, watch, asJSON, shards bool) error {
	return a.watch(cmd, watch, asJSON, func(ctx context.Context, rdb redis.UniversalClient, cfg jobs.Config) (any, error) {
		inspector := asynq.NewInspectorFromRedisClient(rdb)
		defer inspector.Close()
		return takeSnapshot(ctx, rdb, inspector, cfg)
	}, func(w io.Writer, v any) error { return printSnapshot(w, v.(snapshot), shards) })
}

// keysSnapshot is what status --keys shows.
type keysSnapshot struct {
	Time time.Time `json:"time"`
	Gate string    `json:"gate"`
	// Key, with --key, is the key asked for as the gate keeps it (hashed
	// with hash_keys).
	Key  *string     `json:"key,omitempty"`
	Keys []keyStatus `json:"keys"`
}

type keyStatus struct {
	Key string `json:"key"`
	// Waiting is null where the gate's algorithm does not tell.
	Waiting   *int `json:"waiting"`
	Throttled int  `json:"throttled_last_minute"`
	CanAdmit  bool `json:"can_admit_now"`
	Remaining int  `json:"remaining"`
	// Learned, on a keyed adaptive quota, is the rate the fleet learned
	// for the key value, in events per the quota's period; null if none.
	Learned *float64 `json:"learned_rate,omitempty"`
}

// keyStatus prints the busiest keys of gate (with one, value's only), or
// does so every second with watch until ctx is done.
func (a *app) keyStatus(cmd *cobra.Command, gate string, top int, one bool, value string, watch, asJSON bool) error {
	return a.watch(cmd, watch, asJSON, func(ctx context.Context, rdb redis.UniversalClient, cfg jobs.Config) (any, error) {
		s := keysSnapshot{Time: time.Now().UTC().Truncate(time.Millisecond), Gate: gate, Keys: []keyStatus{}}
		cfg, err := jobs.InForce(ctx, rdb, cfg, s.Time) // key values set live keep their state apart
		if err != nil {
			return s, err
		}
		var loads []throttle.KeyLoad
		if one {
			var l throttle.KeyLoad
			var found bool
			l, found, err = jobs.KeyLoadOf(ctx, rdb, cfg, gate, value)
			if found {
				loads = append(loads, l)
			}
			s.Key = &l.Key
		} else {
			loads, err = jobs.KeyLoads(ctx, rdb, cfg, gate, top)
		}
		if err != nil {
			return s, err
		}
		for _, l := range loads {
			k := keyStatus{Key: l.Key, Throttled: l.Throttled, CanAdmit: l.CanAdmit, Remaining: l.Remaining}
			if l.Waiting >= 0 {
				k.Waiting = &l.Waiting
			}
			s.Keys = append(s.Keys, k)
		}
		return s, addLearned(ctx, rdb, cfg, gate, top, &s)
	}, func(w io.Writer, v any) error { return printKeys(w, v.(keysSnapshot)) })
}

// addLearned adds to s, the keys of gate, the rates a keyed adaptive
// quota learned for them; and with no key asked for, the key values with
// a learned rate that hold no other state, up to top keys in all. The
// states of a key value's learned limits are the value's own: the load
// columns are of its state at the quota's start rate (a value's first
// moment, or when a worker forgot it).
func addLearned(ctx context.Context, rdb redis.UniversalClient, cfg jobs.Config, gate string, top int, s *keysSnapshot) error {
	quota := strings.TrimPrefix(gate, "quota:")
	if l, ok := cfg.Quotas[quota]; !ok || l.Adaptive == nil || l.Key == "" {
		return nil
	}
	rates, err := jobs.LearnedKeyRates(ctx, rdb, cfg, quota, jobs.MaxKeyLoads)
	if err != nil {
		return err
	}
	for i, k := range s.Keys {
		if lr, ok := rates[k.Key]; ok {
			s.Keys[i].Learned = &lr.Rate
			delete(rates, k.Key)
		}
	}
	if s.Key != nil {
		if lr, ok := rates[*s.Key]; ok && len(s.Keys) == 0 {
			s.Keys = append(s.Keys, keyStatus{Key: *s.Key, Learned: &lr.Rate})
		}
		return nil
	}
	for _, key := range slices.Sorted(maps.Keys(rates)) {
		if len(s.Keys) >= top {
			break
		}
		lr := rates[key]
		s.Keys = append(s.Keys, keyStatus{Key: key, Learned: &lr.Rate})
	}
	return nil
}

// watch shows what take reads: once, or once a second with watch until
// ctx is done (Ctrl-C).
func (a *app) watch(cmd *cobra.Command, watch, asJSON bool, take func(context.Context, redis.UniversalClient, jobs.Config) (any, error), print func(io.Writer, any) error) error {
	file, rdb, err := a.connect(cmd)
	if err != nil {
		return err
	}
	defer rdb.Close()
	ctx, out := cmd.Context(), cmd.OutOrStdout()
	show := func(s any) error {
		if asJSON {
			return json.NewEncoder(out).Encode(s) // one line
		}
		return print(out, s)
	}
	if !watch {
		s, err := take(ctx, rdb, file.Jobs)
		if errors.As(err, new(*jobs.GateError)) {
			return badInput(err)
		}
		if err != nil {
			return redisFailed(fmt.Errorf("status from %s: %w", redisAt(file.Redis), err))
		}
		return show(s)
	}
	clear := !asJSON && isTerminal(out)
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for first := true; ; first = false {
		s, err := take(ctx, rdb, file.Jobs)
		if ctx.Err() != nil {
			return nil // Ctrl-C
		}
		if errors.As(err, new(*jobs.GateError)) {
			return badInput(err)
		}
		switch {
		case clear:
			fmt.Fprint(out, "\x1b[H\x1b[2J") // home, clear screen
		case !asJSON && !first:
			fmt.Fprintln(out)
		}
		if err != nil {
			// Keep watching: Redis may come back.
			fmt.Fprintf(cmd.ErrOrStderr(), "enqueue: status from %s at %s: %v\n", redisAt(file.Redis), time.Now().Format(time.TimeOnly), err)
		} else if err := show(s); err != nil {
			return err
		}
		select {
		case <-ctx.Done():
			return nil
		case <-tick.C:
		}
	}
}

func printKeys(w io.Writer, s keysSnapshot) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	switch {
	case len(s.Keys) == 0 && s.Key != nil:
		fmt.Fprintf(tw, "KEY %s OF %s at %s: none (it holds no state and throttled no task in the last minute)\n", *s.Key, s.Gate, s.Time.Local().Format(time.DateTime))
		return tw.Flush()
	case len(s.Keys) == 0:
		fmt.Fprintf(tw, "KEYS OF %s at %s: none (no key holds state or throttled a task in the last minute)\n", s.Gate, s.Time.Local().Format(time.DateTime))
		return tw.Flush()
	}
	if s.Key != nil {
		fmt.Fprintf(tw, "KEY %s OF %s at %s\n", *s.Key, s.Gate, s.Time.Local().Format(time.DateTime))
	} else {
		fmt.Fprintf(tw, "KEYS OF %s at %s (the busiest %d)\n", s.Gate, s.Time.Local().Format(time.DateTime), len(s.Keys))
	}
	learned := slices.ContainsFunc(s.Keys, func(k keyStatus) bool { return k.Learned != nil })
	header := "KEY\tWAITING\tTHROTTLED (1m)\tCAN ADMIT NOW"
	if learned {
		header += "\tLEARNED RATE"
	}
	fmt.Fprintln(tw, header)
	for _, k := range s.Keys {
		waiting, admit := "-", "no"
		if k.Waiting != nil {
			waiting = fmt.Sprint(*k.Waiting)
		}
		if k.CanAdmit {
			admit = fmt.Sprintf("yes (%d)", k.Remaining)
		}
		key := k.Key
		if q := strconv.Quote(key); key == "" || q[1:len(q)-1] != key || strings.ContainsAny(key, " \t") {
			key = q
		}
		fmt.Fprintf(tw, "%s\t%s\t%d\t%s", key, waiting, k.Throttled, admit)
		switch {
		case k.Learned != nil:
			fmt.Fprintf(tw, "\t%.2f", *k.Learned)
		case learned:
			fmt.Fprint(tw, "\t-")
		}
		fmt.Fprintln(tw)
	}
	return tw.Flush()
}

// takeSnapshot reads the queues, gates and workers.
func takeSnapshot(ctx context.Context, rdb redis.UniversalClient, inspector *asynq.Inspector, cfg jobs.Config) (snapshot, error) {
	s := snapshot{Time: time.Now().UTC().Truncate(time.Millisecond), Quotas: []gateStatus{}, Workers: []workerStatus{}}
	rl, err := jobs.LoadRuntimeLimits(ctx, rdb)
	if err != nil {
		return s, err
	}
	cfg = cfg.WithRuntimeLimits(rl, s.Time).Defaults()
	cfg, learned, err := jobs.LearnedRates(ctx, rdb, cfg, rl, s.Time)
	if err != nil {
		return s, err
	}
	live := func(g *gateStatus, gate jobs.GateName) {
		for _, r := range rl {
			if r.Gate == gate && r.InForce(s.Time) {
				g.Live = g.Live || r.Key == ""
				if r.Key != "" {
					g.LiveKeys++
				}
			}
		}
	}
	known, err := inspector.Queues()
	if err != nil {
		return s, fmt.Errorf("listing queues: %w", err)
	}
	levels, err := jobs.Levels(ctx, rdb, cfg)
	if err != nil {
		return s, fmt.Errorf("reading gate levels: %w", err)
	}
	// A sharded queue's shards are counted in its row (and listed in its
	// Shards), not as queues of their own.
	shardOf := map[string]string{}
	for name, qc := range cfg.Queues {
		for _, shard := range producer.ShardQueues(name, qc.Shards) {
			if shard != name {
				shardOf[shard] = name
			}
		}
	}
	names := slices.Sorted(maps.Keys(cfg.Queues))
	for _, q := range slices.Sorted(slices.Values(known)) {
		if _, ok := cfg.Queues[q]; !ok && shardOf[q] == "" {
			names = append(names, q)
		}
	}
	for _, name := range names {
		qc, configured := cfg.Queues[name]
		var q queueStatus
		if configured && qc.Shards > 1 {
			for _, shard := range producer.ShardQueues(name, qc.Shards) {
				sq, err := readQueue(ctx, rdb, inspector, known, shard)
				if err != nil {
					return s, err
				}
				if level, ok := levels[jobs.GateName{Kind: jobs.DrainGate, Name: shard}.String()]; ok && qc.Drain != nil {
					sq.Level = &level
					levels[jobs.GateName{Kind: jobs.DrainGate, Name: name}.String()] += level
				}
				q.add(sq)
				q.Shards = append(q.Shards, sq)
			}
			q.Name = name
		} else {
			var err error
			if q, err = readQueue(ctx, rdb, inspector, known, name); err != nil {
				return s, err
			}
		}
		if configured {
			q.Configured = true
			if qc.Drain != nil {
				gate := jobs.GateName{Kind: jobs.DrainGate, Name: name}
				g := newGateStatus("", *qc.Drain, levels, gate.String())
				live(&g, gate)
				q.Drain = &g
			}
		}
		s.Queues = append(s.Queues, q)
	}
	for _, name := range slices.Sorted(maps.Keys(cfg.Quotas)) {
		gate := jobs.GateName{Kind: jobs.QuotaGate, Name: name}
		g := newGateStatus(name, cfg.Quotas[name], levels, gate.String())
		live(&g, gate)
		if a := cfg.Quotas[name].Adaptive; a != nil {
			g.Adaptive = &adaptiveStatus{Min: a.Min, Max: a.Max, Per: shortDuration(cfg.Quotas[name].RatePeriod())}
			if lr, ok := learned[name]; ok {
				rate := math.Round(lr.Rate*100) / 100
				g.Adaptive.Rate, g.Adaptive.Learned = &rate, lr.Since.UTC().Format(time.RFC3339)
			}
		}
		s.Quotas = append(s.Quotas, g)
	}
	servers, err := inspector.Servers()
	if err != nil {
		return s, fmt.Errorf("listing workers: %w", err)
	}
	for _, srv := range servers {
		wk := workerStatus{Host: srv.Host, PID: srv.PID, Concurrency: srv.Concurrency, Active: len(srv.ActiveWorkers),
			Queues: srv.Queues, Started: srv.Started.UTC(), Status: srv.Status}
		if run, wait := cfg.Worker.Concurrency, cfg.Worker.Waiting; srv.Concurrency == run+wait {
			// asynq's concurrency is the worker's slots that run handlers
			// and those that hold tasks waiting (jobs.Scheduler.AsynqConfig).
			wk.Concurrency, wk.WaitingSlots = run, wait
		}
		s.Workers = append(s.Workers, wk)
	}
	slices.SortFunc(s.Workers, func(a, b workerStatus) int {
		if c := strings.Compare(a.Host, b.Host); c != 0 {
			return c
		}
		return a.PID - b.PID
	})
	return s, nil
}

// maxClassified bounds how many tasks of a queue's retry set, and of its
// scheduled set, status reads to tell those waiting for their turn.
const maxClassified = 10_000

// classifyPage is how many tasks status reads at once to classify them.
const classifyPage = 1000

// readQueue reads what asynq holds of queue (all zero if it has never
// been enqueued to: it is not among known) and the fleet's rate of it.
func readQueue(ctx context.Context, rdb redis.UniversalClient, inspector *asynq.Inspector, known []string, name string) (queueStatus, error) {
	q := queueStatus{Name: name}
	// A configured queue that was never enqueued to is unknown to asynq
	// (its GetQueueInfo error, NOT_FOUND, is not ErrQueueNotFound): all zero.
	if slices.Contains(known, name) {
		info, err := inspector.GetQueueInfo(name)
		if err != nil {
			return q, fmt.Errorf("queue %q: %w", name, err)
		}
		q.Paused, q.Pending, q.Scheduled, q.Retry = info.Paused, info.Pending, info.Scheduled, info.Retry
		q.Active, q.Archived, q.Aggregating, q.Completed = info.Active, info.Archived, info.Aggregating, info.Completed
		if err := countWaiting(inspector, &q); err != nil {
			return q, fmt.Errorf("queue %q: %w", name, err)
		}
	}
	rate, err := jobs.RecentRate(ctx, rdb, name)
	if err != nil {
		return q, fmt.Errorf("queue %q: rate: %w", name, err)
	}
	q.RatePerSecond = rate
	return q, nil
}

// add adds a shard's counts and rate to q, its sharded queue's row; q is
// paused if any shard is.
func (q *queueStatus) add(shard queueStatus) {
	q.Paused = q.Paused || shard.Paused
	q.Pending += shard.Pending
	q.Waiting += shard.Waiting
	q.WaitingAtLeast = q.WaitingAtLeast || shard.WaitingAtLeast
	q.Scheduled += shard.Scheduled
	q.Retry += shard.Retry
	q.Active += shard.Active
	q.Archived += shard.Archived
	q.Aggregating += shard.Aggregating
	q.Completed += shard.Completed
	q.RatePerSecond += shard.RatePerSecond
}

// countWaiting moves q's tasks that wait in Redis for their turn out of
// its Retry and Scheduled counts into Waiting, reading at most
// maxClassified of each set (asynq's retry set holds ids; their last
// errors are in the tasks' hashes, read a page at a time).
func countWaiting(inspector *asynq.Inspector, q *queueStatus) error {
	count := func(total int, list func(string, ...asynq.ListOption) ([]*asynq.TaskInfo, error)) (int, error) {
		waiting := 0
		for page := 1; (page-1)*classifyPage < min(total, maxClassified); page++ {
			infos, err := list(q.Name, asynq.PageSize(classifyPage), asynq.Page(page))
			if err != nil {
				return 0, err
			}
			for _, info := range infos {
				if jobs.WaitingTask(info) {
					waiting++
				}
			}
			if len(infos) < classifyPage {
				break
			}
		}
		q.WaitingAtLeast = q.WaitingAtLeast || total > maxClassified
		return min(waiting, total), nil // tasks move while the pages are read
	}
	inRetry, err := count(q.Retry, inspector.ListRetryTasks)
	if err != nil {
		return fmt.Errorf("reading its retry set: %w", err)
	}
	inScheduled, err := count(q.Scheduled, inspector.ListScheduledTasks)
	if err != nil {
		return fmt.Errorf("reading its scheduled set: %w", err)
	}
	q.Retry -= inRetry
	q.Scheduled -= inScheduled
	q.Waiting = inRetry + inScheduled
	return nil
}

// newGateStatus is limit l, named name if a quota, with its level from
// levels by its gate's name (drain:<queue>, quota:<name>); none if it is
// keyed.
func newGateStatus(name string, l jobs.LimitConfig, levels map[string]int, gate string) gateStatus {
	g := gateStatus{Name: name, Algorithm: l.Algorithm, Limit: l.Limit, Period: shortDuration(l.Period), Capacity: l.Limit, Key: l.Key}
	if level, ok := levels[gate]; ok && l.Key == "" {
		g.Level = &level
	}
	switch throttle.Algorithm(l.Algorithm) {
	case throttle.TokenBucket, throttle.LeakyBucket:
		g.Burst = l.Burst
		if g.Burst == 0 {
			g.Burst = l.Limit // throttle.Spec: 0 means Limit
		}
		g.Capacity = g.Burst
	}
	return g
}

// describe shows a gate in one cell: "leaky_bucket 20/1s burst 1".
func (g gateStatus) describe() string {
	s := fmt.Sprintf("%s %d/%s", g.Algorithm, g.Limit, g.Period)
	if g.Burst > 0 {
		s += fmt.Sprintf(" burst %d", g.Burst)
	}
	switch {
	case g.Live && g.LiveKeys > 0:
		s += fmt.Sprintf(" (set live; %d keys too: limits list)", g.LiveKeys)
	case g.Live:
		s += " (set live: limits list)"
	case g.LiveKeys > 0:
		s += fmt.Sprintf(" (%d keys set live: limits list --keys)", g.LiveKeys)
	}
	if a := g.Adaptive; a != nil {
		learned := "none learned yet"
		if a.Rate != nil {
			learned = fmt.Sprintf("learned %.2f/%s", *a.Rate, a.Per)
		}
		s += fmt.Sprintf(" (adaptive %d to %d: %s)", a.Min, a.Max, learned)
	}
	return s
}

// admits is the gate's CAN ADMIT NOW: its level, or for a keyed limit
// where to see it per key value.
func (g gateStatus) admits(gate string) string {
	if g.Level == nil {
		return "per key: status --keys " + gate
	}
	return fmt.Sprintf("%d of %d", *g.Level, g.Capacity)
}

// shortDuration drops String's zero units: 1m, not 1m0s.
func shortDuration(d time.Duration) string {
	s := d.String()
	if strings.HasSuffix(s, "m0s") {
		s = strings.TrimSuffix(s, "0s")
	}
	if strings.HasSuffix(s, "h0m") {
		s = strings.TrimSuffix(s, "0m")
	}
	return s
}

func printSnapshot(w io.Writer, s snapshot, shards bool) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintf(tw, "QUEUES at %s\n", s.Time.Local().Format(time.DateTime))
	fmt.Fprintln(tw, "QUEUE\tPENDING\tWAITING\tSCHEDULED\tRETRY\tACTIVE\tARCHIVED\tDONE/S (1m)\tDRAIN\tCAN ADMIT NOW")
	for _, q := range s.Queues {
		name, drain, level := q.Name, "none", "-"
		if q.Paused {
			name += " (paused)"
		}
		switch {
		case !q.Configured:
			drain = "not in config: no worker serves it"
		case q.Drain != nil:
			drain = q.Drain.describe()
			level = q.Drain.admits(jobs.GateName{Kind: jobs.DrainGate, Name: q.Name}.String())
		}
		waiting := fmt.Sprint(q.Waiting)
		if q.WaitingAtLeast {
			waiting += "+"
		}
		fmt.Fprintf(tw, "%s\t%d\t%s\t%d\t%d\t%d\t%d\t%.2f\t%s\t%s\n", name, q.Pending, waiting, q.Scheduled, q.Retry, q.Active, q.Archived, q.RatePerSecond, drain, level)
		if !shards {
			continue
		}
		for i, sh := range q.Shards {
			level := "-"
			if sh.Level != nil {
				level = fmt.Sprint(*sh.Level)
			}
			fmt.Fprintf(tw, "  %s\t%d\t%d\t%d\t%d\t%d\t%d\t%.2f\tshard %d of %d\t%s\n", sh.Name, sh.Pending, sh.Waiting, sh.Scheduled, sh.Retry, sh.Active, sh.Archived, sh.RatePerSecond, i, len(q.Shards), level)
		}
	}
	fmt.Fprintln(tw)
	if len(s.Quotas) > 0 {
		fmt.Fprintln(tw, "QUOTA\tLIMIT\tCAN ADMIT NOW")
		for _, g := range s.Quotas {
			fmt.Fprintf(tw, "%s\t%s\t%s\n", g.Name, g.describe(), g.admits(jobs.GateName{Kind: jobs.QuotaGate, Name: g.Name}.String()))
		}
		fmt.Fprintln(tw)
	}
	if len(s.Workers) == 0 {
		fmt.Fprintln(tw, "WORKERS: none live")
		return tw.Flush()
	}
	fmt.Fprintln(tw, "WORKER HOST\tPID\tCONCURRENCY\tACTIVE\tSTARTED\tUP\tSTATUS")
	for _, wk := range s.Workers {
		concurrency := fmt.Sprint(wk.Concurrency)
		if wk.WaitingSlots > 0 {
			concurrency += fmt.Sprintf(" (+%d waiting)", wk.WaitingSlots)
		}
		fmt.Fprintf(tw, "%s\t%d\t%s\t%d\t%s\t%s\t%s\n", wk.Host, wk.PID, concurrency, wk.Active,
			wk.Started.Local().Format(time.DateTime), s.Time.Sub(wk.Started).Truncate(time.Second), wk.Status)
	}
	return tw.Flush()
}
