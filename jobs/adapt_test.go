package jobs

import (
	"context"
	"math"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/internal/redistest"
)

// controller runs adapt.lua on one quota's state at instants the test
// chooses (ARGV now), with adaptive bounds 5 to 100 and a start of 30 per
// second.
type controller struct {
	t   *testing.T
	rdb redis.UniversalClient
	key string
	t0  time.Time
}

type adaptReply struct {
	rate, before float64
	cause        string
	limit        int
}

func newController(t *testing.T) *controller {
	t.Helper()
	return &controller{t: t, rdb: redistest.Client(t), key: adaptKey(redistest.Queue(t, "adapt")), t0: time.Unix(1_800_000_000, 0)}
}

// report sends one tally at d after t0.
func (c *controller) report(d time.Duration, ok, busy int, stated float64, low bool) adaptReply {
	c.t.Helper()
	lowArg := "0"
	if low {
		lowArg = "1"
	}
	reply, err := adaptScript.Run(context.Background(), c.rdb, []string{c.key}, c.t0.Add(d).UnixMicro(), 5, 100, 30,
		time.Second.Microseconds(), ok, busy, strconv.FormatFloat(stated, 'f', 6, 64), lowArg, 60).StringSlice()
	if err != nil {
		c.t.Fatal(err)
	}
	rate, _ := strconv.ParseFloat(reply[0], 64)
	before, _ := strconv.ParseFloat(reply[1], 64)
	limit, _ := strconv.Atoi(reply[4])
	return adaptReply{rate: rate, before: before, cause: reply[2], limit: limit}
}

// hiddenBucket is an upstream's own limit: limit a second, a burst of a
// fifth of a second of it.
type hiddenBucket struct {
	tokens float64
	limit  float64
}

func (b *hiddenBucket) advance(dt time.Duration) {
	b.tokens = math.Min(math.Max(1, b.limit/5), b.tokens+dt.Seconds()*b.limit)
}

func (b *hiddenBucket) call() bool {
	if b.tokens >= 1 {
		b.tokens--
		return true
	}
	return false
}

// TestAdaptController: the controller alone against a simulated upstream
// whose hidden limit goes 50/s, 20/s, 50/s for 30 s each, a fleet sending
// at the limit in force (evenly, its reports every 250 ms, the limit they
// read back in force from the next step): after each phase's first 10 s
// the upstream lets through at least 90% of its limit; at most 3% of the
// calls are answered 429; the 429s of the drop to 20/s end within 3 s of
// it. The end-to-end test (test/adaptive_test.go) has the same bounds
// with real workers.
func TestAdaptController(t *testing.T) {
	t.Parallel()
	c := newController(t)
	phases := []struct {
		limit float64
		for_  time.Duration
	}{{50, 30 * time.Second}, {20, 30 * time.Second}, {50, 30 * time.Second}}
	const step = 10 * time.Millisecond
	const every = 250 * time.Millisecond
	up := &hiddenBucket{limit: 50, tokens: 10}
	limit, owed := 30, 0.0
	var at time.Duration
	var ok, busy, calls, busyAll int
	var dropEnd time.Duration // the last 429 of those the drop began, before a second without one
	dropQuiet := false
	for i, p := range phases {
		up.limit = p.limit
		from := at
		settledOK := 0
		for ; at < from+p.for_; at += step {
			up.advance(step)
			for owed += float64(limit) * step.Seconds(); owed >= 1; owed-- {
				calls++
				if up.call() {
					ok++
					if at >= from+10*time.Second {
						settledOK++
					}
				} else {
					busy++
					busyAll++
					if i == 1 && !dropQuiet {
						dropEnd = at - from
					}
				}
			}
			if (at+step)%every == 0 {
				r := c.report(at, ok, busy, 0, false)
				ok, busy, limit = 0, 0, r.limit
			}
			if i == 1 && at-from-dropEnd >= time.Second {
				dropQuiet = true
			}
		}
		got := float64(settledOK) / (p.for_ - 10*time.Second).Seconds()
		t.Logf("phase %d: hidden %v/s, %.1f/s after 10 s", i+1, p.limit, got)
		if got < 0.9*p.limit {
			t.Errorf("phase %d: %.1f successes/s after 10 s, want >= 90%% of %v", i+1, got, p.limit)
		}
	}
	t.Logf("%d of %d calls 429 (%.2f%%); the drop's 429s ended %v after it", busyAll, calls, 100*float64(busyAll)/float64(calls), dropEnd)
	if dropEnd > 3*time.Second {
		t.Errorf("the 429s the drop to 20/s began went on for %v, want <= 3s", dropEnd)
	}
	if float64(busyAll) > 0.03*float64(calls) {
		t.Errorf("%d of %d calls answered 429, want <= 3%%", busyAll, calls)
	}
}
