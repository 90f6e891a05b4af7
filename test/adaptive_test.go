package test

import (
	"context"
	"encoding/json"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/sluicehq/sluice/internal/hiddenlimit"
	"github.com/sluicehq/sluice/internal/redistest"
)

// adaptivePhases are the issue's: the API allows 50/s, then 20/s, then
// 50/s again, 30 s each.
var adaptivePhases = []hiddenlimit.Phase{{Limit: 50, For: 30 * time.Second}, {Limit: 20, For: 30 * time.Second}, {Limit: 50, For: 30 * time.Second}}

// TestAdaptiveQuota: 3 workers drain a backlog of http:request tasks
// through a quota adaptive from 5 to 100/s, starting at 30, against an API
// whose hidden limit (its own token bucket, 429 + Retry-After: 1 beyond
// it) goes 50/s, 20/s, 50/s for 30 s each; the first worker is killed with
// -9 mid-run and started again. In each phase after its first 10 s the
// successes are at least 90% of the hidden limit; 429s are at most 3% of
// all calls; the 429s that the drop to 20/s brings end within 3 s of it;
// the restarted worker starts from the fleet's learned rate (its gauge
// when its metrics first answer is the rate in Redis, read just before and
// just after, not the start of 30); no task is lost, archived, failed or
// got through twice.
func TestAdaptiveQuota(t *testing.T) {
	t.Parallel()
	queue := redistest.Queue(t, "adaptive")
	api := hiddenlimit.NewAPI(adaptivePhases, false)
	defer api.Close()
	fleet := hiddenlimit.Fleet{
		Worker: bin + "/worker", Redis: redistest.Addr(t), Dir: t.TempDir(), Queue: queue,
		Quota:   "{algorithm: leaky_bucket, limit: 30, period: 1s, burst: 1, adaptive: {min: 5, max: 100}}",
		Workers: 3, Tasks: 7000, KillAt: 45 * time.Second,
	}
	res, err := fleet.Run(context.Background(), api, adaptivePhases)
	if err != nil {
		t.Fatal(err)
	}
	calls, busy := 0, 0
	for i, s := range hiddenlimit.Stats(res.Calls, adaptivePhases, 10*time.Second) {
		t.Logf("phase %d: limit %d/s, %d calls, %d 429s, %.1f successes/s, %.1f/s after 10 s (%.0f%%)", i+1, s.Limit, s.Calls, s.Busy, s.OKPerSecond, s.Settled, 100*s.SettledShare)
		if s.SettledShare < 0.9 {
			t.Errorf("phase %d: %.1f successes/s after its first 10 s, %.0f%% of the hidden %d/s; want >= 90%%", i+1, s.Settled, 100*s.SettledShare, s.Limit)
		}
		calls += s.Calls
		busy += s.Busy
	}
	if share := float64(busy) / float64(calls); share > 0.03 {
		t.Errorf("%d of %d calls answered 429 (%.1f%%), want <= 3%%", busy, calls, 100*share)
	}
	end := hiddenlimit.BusyEnd(res.Calls, adaptivePhases[0].For)
	t.Logf("the 429s after the drop to 20/s ended %v after it", end.Round(time.Millisecond))
	if end > 3*time.Second {
		t.Errorf("the 429s after the drop to 20/s went on for %v, want <= 3s", end.Round(time.Millisecond))
	}
	t.Logf("the restarted worker's first learned rate: %.2f/s; the fleet's around its start: %.2f to %.2f/s", res.Restarted, res.FleetRate[0], res.FleetRate[1])
	if res.Restarted < res.FleetRate[0] || res.Restarted > res.FleetRate[1] {
		t.Errorf("the restarted worker started at %.2f/s, want the fleet's learned rate then (%.2f to %.2f/s), not the start of 30", res.Restarted, res.FleetRate[0], res.FleetRate[1])
	}
	if res.Twice > 0 || res.Archived > 0 || res.Failed > 0 || res.Unaccounted != 0 {
		t.Errorf("%d tasks got through twice, %d archived, %d failed, %d unaccounted; want none", res.Twice, res.Archived, res.Failed, res.Unaccounted)
	}
}

// TestAdaptiveStatedLimit: an API that states its limit (RateLimit-Policy
// and X-RateLimit-Limit: 50 a second) in every answer: the adaptive quota
// (start 30) takes it as it is, with no 429 needed: from 5 s on, the 3
// workers' successes are at least 95% of it, at most 1% of the calls are
// answered 429, and the learned rate at the end is within 5% of 50.
func TestAdaptiveStatedLimit(t *testing.T) {
	t.Parallel()
	phases := []hiddenlimit.Phase{{Limit: 50, For: 10 * time.Second}}
	api := hiddenlimit.NewAPI(phases, true)
	defer api.Close()
	fleet := hiddenlimit.Fleet{
		Worker: bin + "/worker", Redis: redistest.Addr(t), Dir: t.TempDir(), Queue: redistest.Queue(t, "stated"),
		Quota:   "{algorithm: leaky_bucket, limit: 30, period: 1s, burst: 1, adaptive: {min: 5, max: 100}}",
		Workers: 3, Tasks: 1000,
	}
	res, err := fleet.Run(context.Background(), api, phases)
	if err != nil {
		t.Fatal(err)
	}
	s := hiddenlimit.Stats(res.Calls, phases, 5*time.Second)[0]
	t.Logf("%d calls, %d 429s, %.1f successes/s after 5 s; learned rate at the end %.2f/s", s.Calls, s.Busy, s.Settled, res.Final)
	if s.Settled < 0.95*50 {
		t.Errorf("%.1f successes/s after 5 s, want >= 95%% of the stated 50/s", s.Settled)
	}
	if float64(s.Busy) > 0.01*float64(s.Calls) {
		t.Errorf("%d of %d calls answered 429, want <= 1%%", s.Busy, s.Calls)
	}
	if res.Final < 47.5 || res.Final > 52.5 {
		t.Errorf("the learned rate is %.2f/s, want within 5%% of the stated 50/s", res.Final)
	}
	// enqueue status shows the learned rate, and the limit in force.
	r := runEnqueue(t, fleet.Redis, nil, "--config", filepath.Join(fleet.Dir, fleet.Queue+".yaml"), "status", "--json")
	var doc struct {
		Quotas []struct {
			Name     string
			Limit    int
			Adaptive *struct {
				Rate     *float64
				Min, Max int
			}
		}
	}
	if err := json.Unmarshal([]byte(r.stdout), &doc); r.code != 0 || err != nil {
		t.Fatalf("status --json: %v\n%v", err, r)
	}
	if q := doc.Quotas; len(q) != 1 || q[0].Limit != 50 || q[0].Adaptive == nil || q[0].Adaptive.Rate == nil || *q[0].Adaptive.Rate != res.Final || q[0].Adaptive.Min != 5 {
		t.Errorf("status --json shows the quotas %+v; want limit 50, adaptive rate %.2f, min 5", q, res.Final)
	}
	if r := runEnqueue(t, fleet.Redis, nil, "--config", filepath.Join(fleet.Dir, fleet.Queue+".yaml"), "status"); !strings.Contains(r.stdout, "adaptive 5 to 100: learned 50.00/1s") {
		t.Errorf("status does not show the learned rate:\n%v", r)
	}
	if res.Twice > 0 || res.Archived > 0 || res.Failed > 0 || res.Unaccounted != 0 {
		t.Errorf("%d tasks got through twice, %d archived, %d failed, %d unaccounted; want none", res.Twice, res.Archived, res.Failed, res.Unaccounted)
	}
}

// keyedLimits are the keyed case: 10 destinations, each allowing
// its own rate from 2/s to 40/s (153/s together).
var keyedLimits = map[string]int{"d02": 2, "d03": 3, "d05": 5, "d07": 7, "d10": 10, "d14": 14, "d18": 18, "d24": 24, "d30": 30, "d40": 40}

// TestAdaptiveKeyedQuota: 3 workers drain a backlog of http:request tasks
// to 10 destinations through one quota keyed by destination, adaptive from
// 1 to 100/s per destination, starting at 10 (the static keyed quota of
// issue 23's measurement: 28.5% of all calls 429, the large destinations
// at a quarter of their limits), against an API that allows each
// destination its own hidden rate, 2/s to 40/s, for 35 s (the destinations
// below 10/s one call an interval apart, a burst of 1): at most 3% of all
// calls answered 429, and from 15 s on each destination at least 85% of
// its hidden limit (issue 23's lines). Until the controller judged limits
// in tenths as the upstream saw them (2026-12-07, jobs'
// TestAdaptTenthsAsTheUpstreamSaw), the destinations of 2 to 5/s were held
// to 65% here: 2/s used 82 to 95% (82% in a run of the whole package), 3/s
// 85 to 95%. Since, 6 runs (2 quiet, 3 beside four or six CPU-bound
// processes, 1 in the whole package): 2/s 90 to 95%, 3/s 93 to 97%, 5/s
// 91 to 96%, 7/s and more 95 to 100%, 429s 1.6 to 1.9% of all calls.
// enqueue status --keys shows each destination's learned rate, the small
// destinations' below the large ones'; no task lost, archived, failed or
// got through twice.
func TestAdaptiveKeyedQuota(t *testing.T) {
	t.Parallel()
	const run, settle = 35 * time.Second, 15 * time.Second
	api := hiddenlimit.NewKeyedAPI(keyedLimits, run)
	defer api.Close()
	tasks := map[string]int{}
	for dest, limit := range keyedLimits {
		tasks[dest] = int(float64(limit)*run.Seconds()*1.3) + 10 // a backlog throughout, for every destination
	}
	fleet := hiddenlimit.Fleet{
		Worker: bin + "/worker", Redis: redistest.Addr(t), Dir: t.TempDir(), Queue: redistest.Queue(t, "adaptkeyed"),
		Quota:   `{algorithm: leaky_bucket, limit: 10, period: 1s, burst: 1, key: 'payload.headers["` + hiddenlimit.KeyHeader + `"]', adaptive: {min: 1, max: 100}}`,
		Workers: 3, KeyTasks: tasks,
	}
	res, err := fleet.Run(context.Background(), api, []hiddenlimit.Phase{{For: run}})
	if err != nil {
		t.Fatal(err)
	}
	calls, busy := 0, 0
	for _, s := range hiddenlimit.StatsByKey(res.Calls, keyedLimits, run, settle) {
		t.Logf("%s: limit %d/s, %d calls, %d 429s, %.2f successes/s after %v (%.0f%%)", s.Key, s.Limit, s.Calls, s.Busy, s.Settled, settle, 100*s.SettledShare)
		if s.SettledShare < 0.85 {
			t.Errorf("%s: %.2f successes/s after %v, %.0f%% of its hidden %d/s; want >= 85%%", s.Key, s.Settled, settle, 100*s.SettledShare, s.Limit)
		}
		calls += s.Calls
		busy += s.Busy
	}
	t.Logf("%d calls, %d answered 429 (%.1f%%)", calls, busy, 100*float64(busy)/float64(calls))
	if float64(busy) > 0.03*float64(calls) {
		t.Errorf("%d of %d calls answered 429 (%.1f%%), want <= 3%%", busy, calls, 100*float64(busy)/float64(calls))
	}
	r := runEnqueue(t, fleet.Redis, nil, "--config", filepath.Join(fleet.Dir, fleet.Queue+".yaml"), "status", "--keys", "quota:api-"+fleet.Queue, "--json")
	var doc struct {
		Keys []struct {
			Key     string
			Learned *float64 `json:"learned_rate"`
		}
	}
	if err := json.Unmarshal([]byte(r.stdout), &doc); r.code != 0 || err != nil {
		t.Fatalf("status --keys --json: %v\n%v", err, r)
	}
	learned := map[string]float64{}
	for _, k := range doc.Keys {
		if k.Learned != nil {
			learned[k.Key] = *k.Learned
		}
	}
	t.Logf("status --keys: learned rates %v", learned)
	if len(learned) != len(keyedLimits) || learned["d02"] >= learned["d40"] || learned["d03"] >= learned["d30"] {
		t.Errorf("status --keys shows the learned rates %v; want one per destination, the small ones' below the large ones'", learned)
	}
	if res.Twice > 0 || res.Archived > 0 || res.Failed > 0 || res.Unaccounted != 0 {
		t.Errorf("%d tasks got through twice, %d archived, %d failed, %d unaccounted; want none", res.Twice, res.Archived, res.Failed, res.Unaccounted)
	}
}
