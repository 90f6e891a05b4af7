package jobs

import (
	"cmp"
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"

	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/throttle"
)

// MaxKeyLoads bounds how many keys KeyLoads returns.
const MaxKeyLoads = 1000

// maxGateName bounds a gate's name as KeyLoads takes it: a longer one names
// no gate, and is not echoed back whole.
const maxGateName = 512

// GateError is KeyLoads' answer when it is asked for what it cannot list:
// a gate that is not a keyed gate of the config, or a bad count.
type GateError struct{ Problem string }

func (e *GateError) Error() string { return "jobs: " + e.Problem }

// KeyLoads returns the busiest keys of cfg's keyed gate named gate, at
// most top of them (1 to MaxKeyLoads): the most throttled in the last
// minute first, then the most waiting, then those that cannot admit now,
// then by key value. Gates are named as their metrics' gate label:
// "drain:<queue>" and "quota:<name>" (keyed by `key:`, their overrides
// included), "fair:<queue>" (a queue's fairness), "concurrency:type:<type>"
// (concurrency_key); a quota's bare name will do when no other gate has it.
// It reads Redis (one SCAN pass over the keyspace for the gate and its
// overrides), counts nothing, and is for operators: see throttle.Loads.
func KeyLoads(ctx context.Context, rdb redis.UniversalClient, cfg Config, gate string, top int) ([]throttle.KeyLoad, error) {
	if top < 1 || top > MaxKeyLoads {
		return nil, &GateError{fmt.Sprintf("the keys listed must be 1 to %d, got %d", MaxKeyLoads, top)}
	}
	name, g, err := findKeyedGate(rdb, cfg, gate)
	if err != nil {
		return nil, err
	}
	loads, err := g.read(ctx)
	if err != nil {
		return nil, fmt.Errorf("jobs: keys of %s: %w", name, err)
	}
	slices.SortFunc(loads, func(a, b throttle.KeyLoad) int {
		return cmp.Or(cmp.Compare(b.Throttled, a.Throttled), cmp.Compare(b.Waiting, a.Waiting),
			compareBool(a.CanAdmit, b.CanAdmit), strings.Compare(a.Key, b.Key))
	})
	return loads[:min(top, len(loads))], nil
}

// KeyLoadOf returns the load of one key value of cfg's keyed gate named
// gate (as KeyLoads names gates), as KeyLoads reads it; not found if the
// key holds no state and throttled nothing in the last minute. value is
// what the gate's key expression gives; a limit with hash_keys keeps it by
// its hash, which is what the load's Key names (the value itself is not
// in Redis).
func KeyLoadOf(ctx context.Context, rdb redis.UniversalClient, cfg Config, gate, value string) (throttle.KeyLoad, bool, error) {
	name, g, err := findKeyedGate(rdb, cfg, gate)
	if err != nil {
		return throttle.KeyLoad{}, false, err
	}
	loads, err := g.read(ctx)
	if err != nil {
		return throttle.KeyLoad{}, false, fmt.Errorf("jobs: keys of %s: %w", name, err)
	}
	want := g.stored(keyValue(value))
	i := slices.IndexFunc(loads, func(l throttle.KeyLoad) bool { return l.Key == want })
	if i < 0 {
		return throttle.KeyLoad{Key: want}, false, nil
	}
	return loads[i], true, nil
}

// findKeyedGate finds cfg's keyed gate named gate, and its full name; a
// *GateError if there is none.
func findKeyedGate(rdb redis.UniversalClient, cfg Config, gate string) (string, keyedGate, error) {
	if len(gate) > maxGateName {
		return "", keyedGate{}, &GateError{fmt.Sprintf("a gate's name is at most %d bytes, got %d (%q...)", maxGateName, len(gate), gate[:32])}
	}
	cfg = cfg.Defaults()
	gs, err := newGateSet(rdb, cfg, gateOptions{lease: slotLease})
	if err != nil {
		return "", keyedGate{}, err
	}
	keyed := gs.keyedGates()
	names := describeGates(slices.Sorted(maps.Keys(keyed)))
	name := gate
	if strings.Contains(gate, ":") {
		if _, err := ParseGateName(gate); err != nil {
			return "", keyedGate{}, &GateError{fmt.Sprintf("%v; the config's keyed gates are %s", err, names)}
		}
	} else { // a bare name is a quota's
		name = GateName{QuotaGate, gate}.String()
		if _, isQueue := cfg.Queues[gate]; isQueue {
			return "", keyedGate{}, &GateError{fmt.Sprintf("%q is a queue: name one of its gates, as %s or %s; the config's keyed gates are %s", gate, GateName{DrainGate, gate}, GateName{FairGate, gate}, names)}
		}
	}
	g, ok := keyed[name]
	if !ok {
		return "", keyedGate{}, &GateError{fmt.Sprintf("%q is not a keyed gate of the config; its keyed gates are %s", gate, names)}
	}
	return name, g, nil
}

// compareBool orders false before true.
func compareBool(a, b bool) int {
	switch {
	case a == b:
		return 0
	case a:
		return 1
	}
	return -1
}

func describeGates(names []string) string {
	if len(names) == 0 {
		return "none"
	}
	return strings.Join(names, ", ")
}

// keyedGate is how to read a keyed gate's keys, and how it keeps a key
// value (hashed with hash_keys).
type keyedGate struct {
	read   func(context.Context) ([]throttle.KeyLoad, error)
	stored func(string) string
}

// keyedGates gives the keyed gates by name.
func (gs *gateSet) keyedGates() map[string]keyedGate {
	asIs := func(v string) string { return v }
	gates := map[string]keyedGate{}
	for _, set := range []map[string]*gate{gs.drains, gs.quotas} {
		for _, g := range set {
			if g.expr == nil {
				continue
			}
			// Each override keeps its one key value under a prefix of its
			// own: read with the gate's in one scan.
			lims := []throttle.Limiter{g.lim}
			for _, o := range g.overrides.all() {
				lims = append(lims, o.lim)
			}
			gates[g.name] = keyedGate{func(ctx context.Context) ([]throttle.KeyLoad, error) { return throttle.Loads(ctx, lims...) }, g.limit.storedKey}
		}
	}
	for _, f := range gs.fair {
		gates[f.name] = keyedGate{func(ctx context.Context) ([]throttle.KeyLoad, error) { return throttle.Loads(ctx, f.lim) }, asIs}
	}
	for typ, sem := range gs.typeSem {
		if gs.typeKey[typ] != nil {
			gates["concurrency:type:"+typ] = keyedGate{sem.Loads, asIs}
		}
	}
	return gates
}
