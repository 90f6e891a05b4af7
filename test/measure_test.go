// Measures over the arrival times an upstream noted: rates, the most
// events beyond an allowance, the densest window.

package test

import (
	"strings"
	"time"
)

// rate is the events per second from the first of times to the last.
func rate(times []time.Time) float64 {
	if len(times) < 2 {
		return 0
	}
	return float64(len(times)-1) / times[len(times)-1].Sub(times[0]).Seconds()
}

// overAllowance is the most events that any interval of times saw beyond
// burst + perSecond·T, T its length plus the measuring tolerance: 0 when a
// token bucket of that shape was never exceeded.
func overAllowance(times []time.Time, burst, perSecond float64) float64 {
	return overAllowanceWithin(times, burst, perSecond, within)
}

// overAllowanceWithin is overAllowance with a measuring tolerance of tol.
func overAllowanceWithin(times []time.Time, burst, perSecond float64, tol time.Duration) float64 {
	worst := 0.0
	for i := range times {
		for j := i; j < len(times); j++ {
			span := times[j].Sub(times[i]) + tol
			worst = max(worst, float64(j-i+1)-(burst+perSecond*span.Seconds()))
		}
	}
	return worst
}

// quotaUse is the share of a token bucket's allowance (burst + rate·T over
// the span of times) that times used.
func quotaUse(times []time.Time, burst, perSecond float64) float64 {
	span := times[len(times)-1].Sub(times[0])
	return float64(len(times)) / (burst + perSecond*span.Seconds())
}

// densest describes the window of length d that holds the most times: the
// gaps between them, for a failure message.
func densest(times []time.Time, d time.Duration) string {
	best, bestFirst, first := 0, 0, 0
	for last := range times {
		for times[last].Sub(times[first]) >= d {
			first++
		}
		if last-first+1 > best {
			best, bestFirst = last-first+1, first
		}
	}
	var gaps []string
	for i := bestFirst + 1; i < bestFirst+best; i++ {
		gaps = append(gaps, times[i].Sub(times[i-1]).Round(time.Millisecond).String())
	}
	return "gaps " + strings.Join(gaps, " ")
}

// between is the times in [from, to).
func between(times []time.Time, from, to time.Time) []time.Time {
	var in []time.Time
	for _, at := range times {
		if !at.Before(from) && at.Before(to) {
			in = append(in, at)
		}
	}
	return in
}
