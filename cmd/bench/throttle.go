package main

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"github.com/go-redis/redis_rate/v10"

	"github.com/sluicehq/sluice/algorithms"
	"github.com/sluicehq/sluice/throttle"
)

// The load shape of the throttle section: many callers on many keys, one
// shared client with a connection per caller.
const (
	throttleConcurrency = 50
	throttleKeys        = 10_000
)

// throttleSpec is the limit every algorithm runs with. redisRateLimit is the
// same limit for the peer, redis_rate: 100 per second with a burst of 100.
func throttleSpec(a throttle.Algorithm) throttle.Spec {
	return throttle.Spec{Algorithm: a, Limit: 100, Period: time.Second, Burst: 100, Windows: 10}
}

var redisRateLimit = redis_rate.PerSecond(100)

const redisRateName = "redis_rate"

// How each contender is measured; a measurement's name is the contender's
// and one of these.
const (
	fromGo             = " from Go"
	fromGoUnpipelined  = " from Go, WithPipelining(0)"
	withRedisBenchmark = " with redis-benchmark"
)

// memoryResult is MEMORY USAGE of one key, in bytes.
type memoryResult struct {
	key                    string
	afterOne, afterHundred int64
}

// runThrottle measures the five algorithms and redis_rate: decisions per
// second from Go and with redis-benchmark, and the memory one key takes.
func runThrottle(ctx context.Context, b *bench) error {
	goSide, admitted, err := goMeasurements(ctx, b)
	if err != nil {
		return err
	}
	serverSide, err := serverSideMeasurements(ctx, b)
	if err != nil {
		return err
	}
	rates, err := inRounds(ctx, b, append(goSide, serverSide...))
	if err != nil {
		return err
	}
	memory, err := measureMemory(ctx, b)
	if err != nil {
		return err
	}
	printThrottle(b, rates, admitted, memory)
	return nil
}

// goMeasurements returns a measurement per contender, each of
// throttleConcurrency goroutines deciding on keys picked at random from
// throttleKeys, and the tally of their decisions over all rounds. All
// contenders use the same caller keys; their Redis keys differ. Every
// algorithm runs twice: as New makes it, and with WithPipelining(0), one
// round trip per call as redis_rate makes them.
func goMeasurements(ctx context.Context, b *bench) ([]measurement, map[string]*tally, error) {
	allow := map[string]allowFunc{}
	var names []string
	for _, a := range throttle.Algorithms {
		for _, way := range []struct {
			suffix string
			opts   []throttle.Option
		}{
			{fromGo, nil},
			{fromGoUnpipelined, []throttle.Option{throttle.WithPipelining(0), throttle.WithPrefix("sluice:unpipelined:" + string(a) + ":")}},
		} {
			lim, err := throttle.New(b.rdb, throttleSpec(a), way.opts...)
			if err != nil {
				return nil, nil, fmt.Errorf("throttle.New(%s): %w", a, err)
			}
			allow[string(a)+way.suffix] = func(ctx context.Context, key string) (bool, error) {
				d, err := lim.AllowN(ctx, key, 1)
				return d.Allowed, err
			}
			names = append(names, string(a)+way.suffix)
		}
	}
	peer := redis_rate.NewLimiter(b.rdb)
	names = append(names, redisRateName+fromGo)
	allow[redisRateName+fromGo] = func(ctx context.Context, key string) (bool, error) {
		r, err := peer.Allow(ctx, key, redisRateLimit)
		if err != nil {
			return false, fmt.Errorf("redis_rate: %w", err)
		}
		return r.Allowed > 0, nil
	}

	keys := make([]string, throttleKeys)
	for i := range keys {
		keys[i] = b.runID + ":" + strconv.Itoa(i)
	}
	var measurements []measurement
	tallies := map[string]*tally{}
	for _, name := range names {
		// An untimed warm-up loads the script, opens the pool's connections
		// and creates the keys, which the first round would pay for.
		b.progress("throttle: warm-up: %s", name)
		if _, err := measureLoad(ctx, b.duration/4, throttleConcurrency, keys, allow[name]); err != nil {
			return nil, nil, fmt.Errorf("%s, warm-up: %w", name, err)
		}
		total := &tally{}
		tallies[name] = total
		measurements = append(measurements, measurement{name, func(ctx context.Context) (float64, error) {
			t, err := measureLoad(ctx, b.duration, throttleConcurrency, keys, allow[name])
			total.calls += t.calls
			total.admitted += t.admitted
			return t.perSecond(), err
		}})
	}
	return measurements, tallies, nil
}

// serverSideMeasurements returns, per algorithm, a measurement that has
// redis-benchmark send the very call (FCALL where the server has functions,
// EVALSHA where not) that AllowN(ctx, key, 1) sends, on
// keys picked at random: that costs the server what a Go caller costs it and
// the client very little, so its rate is near the most this server can do
// with the script. redis_rate has none: it does not export its script.
func serverSideMeasurements(ctx context.Context, b *bench) ([]measurement, error) {
	rdb, rec := b.recordingClient()
	defer rdb.Close()
	var measurements []measurement
	// Loaded, so that AllowN sends EVALSHA and not the EVAL it falls back to
	// (where the server has functions, AllowN's first call loads them).
	if err := algorithms.BookScript.Load(ctx, rdb); err != nil {
		return nil, fmt.Errorf("SCRIPT LOAD: %w", err)
	}
	for _, a := range throttle.Algorithms {
		lim, err := throttle.New(rdb, throttleSpec(a))
		if err != nil {
			return nil, fmt.Errorf("throttle.New(%s): %w", a, err)
		}
		// redis-benchmark -r replaces every __rand_int__ with a random
		// number, each one its own: a script's second key (the block key)
		// then belongs to another caller key, which costs a standalone
		// server the same.
		if _, err := lim.AllowN(ctx, b.runID+":__rand_int__", 1); err != nil {
			return nil, fmt.Errorf("%s: recording AllowN: %w", a, err)
		}
		command, _, err := rec.lastScriptCall()
		if err != nil {
			return nil, fmt.Errorf("%s: recording AllowN: %w", a, err)
		}
		// redis-benchmark takes a number of requests, not a duration: a short
		// untimed run sizes the timed ones to last about b.duration.
		b.progress("throttle: sizing: %s%s: redis-benchmark ... %q", a, withRedisBenchmark, command)
		rps, err := redisBenchmark(ctx, b.addr, throttleConcurrency, 20_000, throttleKeys, command...)
		if err != nil {
			return nil, fmt.Errorf("%s%s, sizing run: %w", a, withRedisBenchmark, err)
		}
		requests := max(20_000, int(rps*b.duration.Seconds()))
		measurements = append(measurements, measurement{string(a) + withRedisBenchmark, func(ctx context.Context) (float64, error) {
			return redisBenchmark(ctx, b.addr, throttleConcurrency, requests, throttleKeys, command...)
		}})
	}
	return measurements, nil
}

// steppedClock is moved by hand, so that memory is measured on exact
// timelines.
type steppedClock struct{ now time.Time }

func (c *steppedClock) Now() time.Time { return c.now }

// After: the clock moves only between measurements, so only a wait of 0
// or less ends (the limiters never wait on it).
func (c *steppedClock) After(d time.Duration) <-chan time.Time {
	ch := make(chan time.Time, 1)
	if d <= 0 {
		ch <- c.now
	}
	return ch
}

const memoryEvents = 100

// measureMemory admits memoryEvents events on one fresh key per algorithm,
// spread evenly over one Period, and reads MEMORY USAGE after the first and
// the last. Spreading them fills every sub-window of sliding_counter and
// gives every sliding_log entry its own time, as a key at its limit has.
func measureMemory(ctx context.Context, b *bench) (map[string]memoryResult, error) {
	rdb, rec := b.recordingClient()
	defer rdb.Close()
	key := b.runID + ":memory"
	results := map[string]memoryResult{}
	for _, a := range throttle.Algorithms {
		spec := throttleSpec(a)
		clock := &steppedClock{}
		lim, err := throttle.New(rdb, spec, throttle.WithClock(clock))
		if err != nil {
			return nil, fmt.Errorf("throttle.New(%s): %w", a, err)
		}
		start := time.Now().Truncate(spec.Period) // so that one fixed window holds them all
		results[string(a)], err = keyMemory(ctx, b, rec, func(event int) (bool, error) {
			clock.now = start.Add(time.Duration(event) * spec.Period / memoryEvents)
			d, err := lim.AllowN(ctx, key, 1)
			return d.Allowed, err
		})
		if err != nil {
			return nil, fmt.Errorf("memory of %s: %w", a, err)
		}
	}
	// redis_rate reads Redis TIME only, so its events come as fast as the
	// calls; its state is one number whatever the timeline.
	peer := redis_rate.NewLimiter(rdb)
	var err error
	results[redisRateName], err = keyMemory(ctx, b, rec, func(int) (bool, error) {
		r, err := peer.Allow(ctx, key, redisRateLimit)
		return err == nil && r.Allowed > 0, err
	})
	if err != nil {
		return nil, fmt.Errorf("memory of redis_rate: %w", err)
	}
	return results, nil
}

// keyMemory makes memoryEvents calls of allow, which must all be admitted,
// and reads MEMORY USAGE of the key they wrote (the first key of the script
// call rec saw) after the first call and the last.
func keyMemory(ctx context.Context, b *bench, rec *recorder, allow func(event int) (bool, error)) (memoryResult, error) {
	var r memoryResult
	for event := range memoryEvents {
		allowed, err := allow(event)
		if err != nil {
			return r, fmt.Errorf("event %d: %w", event+1, err)
		}
		if !allowed {
			return r, fmt.Errorf("event %d of %d was denied, want all admitted", event+1, memoryEvents)
		}
		if event == 0 || event == memoryEvents-1 {
			if _, r.key, err = rec.lastScriptCall(); err != nil {
				return r, fmt.Errorf("event %d: %w", event+1, err)
			}
			bytes, err := b.rdb.MemoryUsage(ctx, r.key, 0).Result()
			if err != nil {
				return r, fmt.Errorf("MEMORY USAGE %s after event %d: %w", r.key, event+1, err)
			}
			if event == 0 {
				r.afterOne = bytes
			}
			r.afterHundred = bytes
		}
	}
	return r, nil
}

func printThrottle(b *bench, rates map[string]float64, admitted map[string]*tally, memory map[string]memoryResult) {
	w := b.out
	peer := rates[redisRateName+fromGo]
	fmt.Fprintf(w, "### throttle: decisions per second\n\n")
	fmt.Fprintf(w, "Go: %d goroutines share one go-redis client (PoolSize %d) and call `AllowN(ctx, key, 1)` for %v on keys picked at random from %s. "+
		"Every algorithm runs Limit 100 per 1s, Burst 100, Windows 10; redis_rate runs `PerSecond(100)` (burst 100). "+
		"The admitted column shows the mix of decisions: a key is called about (rate / %s) times a second, so unless that nears 100 nearly every call is admitted.\n\n",
		throttleConcurrency, throttleConcurrency, b.duration, grouped(throttleKeys), grouped(throttleKeys))
	fmt.Fprintf(w, "Each algorithm runs twice from Go: as `throttle.New` makes it, where calls that find 4 round trips out wait and share the next one as a pipeline (see `WithPipelining`), "+
		"and with `WithPipelining(0)`, one round trip per call, as redis_rate does it. The second is the script against redis_rate's script; the first is what a caller gets.\n\n")
	fmt.Fprintf(w, "redis-benchmark: the very call that `AllowN(ctx, key, 1)` sends (`FCALL` on Redis 7, `EVALSHA` before) (recorded from go-redis; Redis TIME), from %d connections on %s random keys, for about %v. "+
		"It is a lean C client, so its rate is near what the server can do with that script, and Go, WithPipelining(0) / redis-benchmark is what the Go side keeps of it; "+
		"both clients share the CPUs with the server (see above). redis_rate keeps its script unexported, so it has no redis-benchmark figure.\n\n",
		throttleConcurrency, grouped(throttleKeys), b.duration)
	fmt.Fprintf(w, "Every figure is the median of %d rounds; each round runs every measurement once, one after another.\n\n", b.rounds)
	fmt.Fprintln(w, "| algorithm | Go decisions/s | ratio to redis_rate | Go, WithPipelining(0) | ratio to redis_rate | redis-benchmark decisions/s | Go, WithPipelining(0) / redis-benchmark | admitted (Go) |")
	fmt.Fprintln(w, "|---|--:|--:|--:|--:|--:|--:|--:|")
	for _, name := range algorithmNames() {
		g, u, s := rates[name+fromGo], rates[name+fromGoUnpipelined], rates[name+withRedisBenchmark]
		fmt.Fprintf(w, "| %s | %s | %.2f | %s | %.2f | %s | %.2f | %s |\n", name, grouped(g), g/peer, grouped(u), u/peer, grouped(s), u/s, admitted[name+fromGo].admittedPercent())
	}
	fmt.Fprintf(w, "| %s | — | — | %s | 1.00 | — | — | %s |\n\n", redisRateName, grouped(peer), admitted[redisRateName+fromGo].admittedPercent())

	fmt.Fprintf(w, "### throttle: memory per key\n\n")
	fmt.Fprintf(w, "`MEMORY USAGE key SAMPLES 0` of one key after its first admitted event and after 100, the events spread evenly over one Period (an injected clock, one every 10ms), so sliding_counter fills all 10 sub-windows. "+
		"redis_rate cannot take a clock: its 100 events come back to back. The figures include the key's name: `%s` here, and `%s` for redis_rate.\n\n",
		memory[string(throttle.TokenBucket)].key, memory[redisRateName].key)
	fmt.Fprintln(w, "| algorithm | bytes after 1 event | bytes after 100 events |")
	fmt.Fprintln(w, "|---|--:|--:|")
	for _, name := range append(algorithmNames(), redisRateName) {
		m := memory[name]
		fmt.Fprintf(w, "| %s | %d | %d |\n", name, m.afterOne, m.afterHundred)
	}
	fmt.Fprintln(w)
}

func algorithmNames() []string {
	var names []string
	for _, a := range throttle.Algorithms {
		names = append(names, string(a))
	}
	return names
}
