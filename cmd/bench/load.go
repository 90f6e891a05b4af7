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
	rates := map[string][]float64{}
	for round := 1; round <= b.rounds; round++ {
		for _, m := range measurements {
			rate, err := m.run(ctx)
			if err != nil {
				return nil, fmt.Errorf("%s, round %d: %w", m.name, round, err)
			}
			b.progress("round %d/%d: %s: %s/s", round, b.rounds, m.name, grouped(rate))
			rates[m.name] = append(rates[m.name], rate)
		}
	}
	medians := map[string]float64{}
	for name, r := range rates {
		medians[name] = median(r)
	}
	return medians, nil
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
