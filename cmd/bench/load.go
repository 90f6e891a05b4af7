package main

import (
	"bytes"
	"context"
	"encoding/csv"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"net"
	"os/exec"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
)

// measurement is one contender measured one way.
type measurement struct {
	name string
	run  func(ctx context.Context) (perSecond float64, err error)
}

// inRounds runs every measurement once per round, one after another, so that
// a machine that slows down part-way hurts all of them alike, and returns
// the median rate of each by name.
func inRounds(ctx context.Context, b *bench, measurements []measurement) (map[string]float64, error) {
	rounds, err := eachRound(ctx, b, b.rounds, measurements)
	if err != nil {
		return nil, err
	}
	medians := map[string]float64{}
	for name, r := range rounds {
		medians[name] = median(r)
	}
	return medians, nil
}

// roundRates are the rates of each measurement by name, one per round.
type roundRates map[string][]float64

// eachRound is inRounds for n rounds, with every round's rates. Every
// other round runs the measurements in reverse order, so that none always
// runs right after the same other.
func eachRound(ctx context.Context, b *bench, n int, measurements []measurement) (roundRates, error) {
	rates := roundRates{}
	for round := 1; round <= n; round++ {
		order := slices.Clone(measurements)
		if round%2 == 0 {
			slices.Reverse(order)
		}
		for _, m := range order {
			var rate float64
			var err error
			// Labelled, so that -cpuprofile can be read per measurement
			// (go tool pprof -tagfocus measurement=NAME).
			pprof.Do(ctx, pprof.Labels("measurement", m.name), func(ctx context.Context) { rate, err = m.run(ctx) })
			if err != nil {
				return nil, fmt.Errorf("%s, round %d: %w", m.name, round, err)
			}
			b.progress("round %d/%d: %s: %s/s", round, n, m.name, grouped(rate))
			rates[m.name] = append(rates[m.name], rate)
		}
	}
	return rates, nil
}

// ratio compares measurement a with b round by round, each against the one
// run right beside it: on a shared machine whose speed drifts, a round's
// own ratio is steadier than a ratio of medians. It gives the median of
// the rounds' ratios and the lowest and highest.
func (r roundRates) ratio(a, b string) (mid, lo, hi float64) {
	var ratios []float64
	for i := range r[a] {
		ratios = append(ratios, r[a][i]/r[b][i])
	}
	return median(ratios), slices.Min(ratios), slices.Max(ratios)
}

func median(xs []float64) float64 {
	s := slices.Sorted(slices.Values(xs))
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// allowFunc makes one rate-limit decision for key.
type allowFunc func(ctx context.Context, key string) (allowed bool, err error)

// tally is what one measurement of an allowFunc saw.
type tally struct {
	calls, admitted int64
	elapsed         time.Duration
}

func (t tally) perSecond() float64 { return float64(t.calls) / t.elapsed.Seconds() }

func (t tally) admittedPercent() string {
	return fmt.Sprintf("%.1f%%", 100*float64(t.admitted)/float64(t.calls))
}

// measureLoad calls allow from concurrency goroutines for d, each call on a
// key picked at random from keys, and counts the decisions that came back.
func measureLoad(ctx context.Context, d time.Duration, concurrency int, keys []string, allow allowFunc) (tally, error) {
	tallies := make([]tally, concurrency)
	errs := make([]error, concurrency)
	var wg sync.WaitGroup
	start := time.Now()
	deadline := start.Add(d)
	for g := range concurrency {
		wg.Go(func() {
			var t tally
			for time.Now().Before(deadline) {
				allowed, err := allow(ctx, keys[rand.IntN(len(keys))])
				if err != nil {
					errs[g] = err
					return
				}
				t.calls++
				if allowed {
					t.admitted++
				}
			}
			tallies[g] = t
		})
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return tally{}, err
	}
	total := tally{elapsed: time.Since(start)}
	for _, t := range tallies {
		total.calls += t.calls
		total.admitted += t.admitted
	}
	return total, nil
}

// redisBenchmark runs redis-benchmark against addr with the given clients,
// requests and __rand_int__ range, and returns the requests per second it
// reports for command.
func redisBenchmark(ctx context.Context, addr string, clients, requests, keySpace int, command ...string) (float64, error) {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return 0, fmt.Errorf("redis-benchmark needs host:port, got %q: %w", addr, err)
	}
	args := append([]string{"-h", host, "-p", port,
		"-c", strconv.Itoa(clients), "-n", strconv.Itoa(requests), "-r", strconv.Itoa(keySpace), "--csv"}, command...)
	cmd := exec.CommandContext(ctx, "redis-benchmark", args...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return 0, fmt.Errorf("redis-benchmark %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(stderr.String()))
	}
	rows, err := csv.NewReader(bytes.NewReader(out)).ReadAll()
	if err != nil || len(rows) < 2 || !slices.Contains(rows[0], "rps") {
		return 0, fmt.Errorf("redis-benchmark --csv printed %q, want a header with rps and one row (%v)", out, err)
	}
	rps, err := strconv.ParseFloat(rows[1][slices.Index(rows[0], "rps")], 64)
	if err != nil || math.IsInf(rps, 0) || rps <= 0 {
		return 0, fmt.Errorf("redis-benchmark reported rps %q for %d requests; want a positive number (too few requests to time?)", rows[1], requests)
	}
	return rps, nil
}
