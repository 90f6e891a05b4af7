package throttle_test

import (
	"fmt"
	"slices"
	"time"

	"github.com/sluicehq/sluice/throttle"
)

// event is n events counted at µs at.
type event struct {
	at int64
	n  int
}

func removeEvent(evs []event, e event) []event {
	if i := slices.Index(evs, e); i >= 0 {
		return slices.Delete(evs, i, i+1)
	}
	return evs
}

// conforms is an oracle written from each algorithm's definition, not from
// its implementation: it reports whether the events, wherever they fall in
// time, ever exceed spec's limit.
func conforms(spec throttle.Spec, evs []event) error {
	evs = slices.Clone(evs)
	slices.SortFunc(evs, func(a, b event) int { return int(a.at - b.at) })
	period := spec.Period.Microseconds()
	limit := int64(spec.Limit)
	// sumWithin returns the events in (t-span, t] for t the time of evs[i].
	sumWithin := func(i int, in func(at int64) bool) (sum int64) {
		for _, e := range evs {
			if in(e.at) {
				sum += int64(e.n)
			}
		}
		return sum
	}
	for i, e := range evs {
		var sum int64
		switch spec.Algorithm {
		case throttle.FixedWindow:
			sum = sumWithin(i, func(at int64) bool { return at/period == e.at/period })
		case throttle.SlidingLog:
			sum = sumWithin(i, func(at int64) bool { return at > e.at-period && at <= e.at })
		case throttle.SlidingCounter:
			windows := int64(spec.Windows)
			if windows == 0 {
				windows = 10
			}
			sub := period / windows
			sum = sumWithin(i, func(at int64) bool { return at/sub > e.at/sub-windows && at/sub <= e.at/sub })
		default:
			continue
		}
		if sum > limit {
			return fmt.Errorf("%d events around %v, limit %d: %v", sum, time.UnixMicro(e.at), limit, evs)
		}
	}
	if spec.Algorithm == throttle.TokenBucket || spec.Algorithm == throttle.LeakyBucket {
		// A bucket of Burst that drains Limit per Period must never overflow.
		burst := int64(spec.Burst)
		if burst == 0 {
			burst = limit
		}
		var level, last int64 // × period
		for _, e := range evs {
			level = max(0, level-(e.at-last)*limit) + int64(e.n)*period
			last = e.at
			if level > burst*period {
				return fmt.Errorf("bucket overflows at %v: %v", time.UnixMicro(e.at), evs)
			}
		}
	}
	return nil
}
