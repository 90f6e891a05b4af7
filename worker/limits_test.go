package worker

import (
	"testing"
	"time"

	"github.com/sluicehq/sluice/jobs"
)

// TestLimitsPageRates: the page's admitted and throttled per second are a
// gate's counters' change between the newest sample and the newest one at
// least rateWindow older; none until two samples are that far apart; the
// chart has the rate between each two samples.
func TestLimitsPageRates(t *testing.T) {
	t0 := time.Date(2026, 12, 2, 12, 0, 0, 0, time.UTC)
	sample := func(s float64, admitted, throttled float64) gateSample {
		return gateSample{at: t0.Add(time.Duration(s * float64(time.Second))),
			admitted: map[string]float64{"drain:q": admitted}, throttled: map[string]float64{"drain:q": throttled}}
	}
	samples := []gateSample{sample(0, 0, 0), sample(1.5, 30, 3), sample(3, 60, 6)}
	if a, th := ratesOf(samples, rateBase(samples), "drain:q"); a != nil || th != nil {
		t.Errorf("3 s of samples: %v, %v admitted and throttled per second, want none before %v", *a, *th, rateWindow)
	}
	samples = append(samples, sample(4.5, 90, 9), sample(6, 130, 9))
	// The newest (6 s) against the newest at least 5 s older (0 s; the
	// one at 1.5 s is 4.5 s older): 130 admitted and 9 throttled in 6 s.
	a, th := ratesOf(samples, rateBase(samples), "drain:q")
	if a == nil || *a != 130.0/6 || *th != 9.0/6 {
		t.Errorf("rates over 6 s: %v, %v; want %v and %v", a, th, 130.0/6, 9.0/6)
	}
	if a, _ := ratesOf(samples, rateBase(samples), "quota:other"); a == nil || *a != 0 {
		t.Errorf("a gate with no counts: %v admitted per second, want 0", a)
	}
	h := historyOf(samples, "drain:q")
	want := []ratePair{{t0.Add(1500 * time.Millisecond).UnixMilli(), 20, 2}, {t0.Add(3 * time.Second).UnixMilli(), 20, 2},
		{t0.Add(4500 * time.Millisecond).UnixMilli(), 20, 2}, {t0.Add(6 * time.Second).UnixMilli(), 40.0 / 1.5, 0}}
	if len(h) != len(want) {
		t.Fatalf("history %v, want %v", h, want)
	}
	for i := range want {
		if h[i] != want[i] {
			t.Errorf("history[%d] = %+v, want %+v", i, h[i], want[i])
		}
	}
}

// TestLimitsPageThrough: a queue's backlog is through at the rate the
// fleet did its tasks over the last minute; in a drain's first seconds,
// before there is one, at least as long as at the drain's own rate (a
// quota may hold it back more; the page showed "-" then, when an operator
// looks first); not at a keyed drain's, which is each key's.
func TestLimitsPageThrough(t *testing.T) {
	drain := &jobs.LimitSpec{Algorithm: "leaky_bucket", Limit: 20, Period: "1s", Burst: 1}
	keyed := &jobs.LimitSpec{Algorithm: "leaky_bucket", Limit: 20, Period: "1s", Key: "payload.customer"}
	for _, c := range []struct {
		name    string
		backlog int
		done    float64
		drain   *jobs.LimitSpec
		want    float64 // -1: none
		atLeast bool
	}{
		{"measured", 100, 10, drain, 10, false},
		{"no rate yet: at least at the drain's", 91, 0, drain, 4.55, true},
		{"per 2 s", 91, 0, &jobs.LimitSpec{Limit: 10, Period: "2s"}, 18.2, true},
		{"no rate yet, keyed drain", 91, 0, keyed, -1, false},
		{"no rate yet, no drain", 91, 0, nil, -1, false},
		{"no backlog", 0, 0, drain, 0, false},
	} {
		got, atLeast := throughOf(c.backlog, c.done, c.drain)
		switch {
		case c.want < 0 && got != nil:
			t.Errorf("%s: through in %v s, want none", c.name, *got)
		case c.want >= 0 && (got == nil || *got < c.want-1e-9 || *got > c.want+1e-9 || atLeast != c.atLeast):
			t.Errorf("%s: through in %v (at least: %v), want %v s (%v)", c.name, got, atLeast, c.want, c.atLeast)
		}
	}
}
