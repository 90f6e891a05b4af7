package test

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/sluicehq/sluice/internal/redistest"
)

// keysDoc is `enqueue status --keys <gate> --json`.
type keysDoc struct {
	Gate string
	Keys []struct {
		Key       string
		Waiting   *int
		Throttled int  `json:"throttled_last_minute"`
		CanAdmit  bool `json:"can_admit_now"`
	}
}

// TestEnqueueStatusKeys: a worker serves a fair queue (drain 20/s, by
// tenant) and a queue of tasks to a hot and a cold destination, on a quota
// keyed by destination (4/s burst 4; the fair queue's tasks go to a
// destination with an override far above that). While the hot destination
// and the big tenant are backlogged, status --keys lists each first,
// throttled, with tasks waiting (the hot destination not admitting now: its
// turns are booked ahead; the big tenant may, at the instant its share has
// room), and no other key throttled; a gate that is not keyed is a bad input (exit 2). On the
// standalone server and on the cluster, where each destination's state is
// in a slot of its own.
func TestEnqueueStatusKeys(t *testing.T) {
	t.Parallel()
	for _, b := range backends {
		t.Run(b.name, func(t *testing.T) {
			t.Parallel()
			fair, keyed, quota := redistest.Queue(t, "fair"), redistest.Queue(t, "keyed"), redistest.Queue(t, "per-dest")
			config := fmt.Sprintf(`
worker: {concurrency: 10}
queues:
  %s:
    drain: {algorithm: leaky_bucket, limit: 20, period: 1s, burst: 1}
    fairness: {key: 'payload.headers["X-Tenant"]'}
  %s: {}
quotas:
  %s: {algorithm: token_bucket, limit: 4, period: 1s, burst: 4, key: 'payload.headers["X-Dest"]', overrides: {fairq: {limit: 1000, burst: 1000}}}
tasks:
  http:request: {quotas: [%s]}
`, fair, keyed, quota, quota)
			r := startFleet(t, b, 1, config)
			path := writeConfig(t, b.yaml(t)+"\n"+config)
			client := asynq.NewClient(r.asynqOpt(t))
			defer client.Close()
			enqueueWithHeaders(t, client, r.u.URL, fair, "big", 100, map[string]string{"X-Tenant": "big", "X-Dest": "fairq"})
			enqueueWithHeaders(t, client, r.u.URL, fair, "small", 2, map[string]string{"X-Tenant": "small", "X-Dest": "fairq"})
			enqueueWithHeaders(t, client, r.u.URL, keyed, "hot", 24, map[string]string{"X-Dest": "hot"})
			enqueueWithHeaders(t, client, r.u.URL, keyed, "cold", 4, map[string]string{"X-Dest": "cold"})
			time.Sleep(1500 * time.Millisecond)

			status := func(gate string) keysDoc {
				t.Helper()
				run := runEnqueue(t, redistest.Addr(t), nil, "--config", path, "status", "--keys", gate, "--json")
				var doc keysDoc
				if err := json.Unmarshal([]byte(run.stdout), &doc); run.code != 0 || err != nil {
					t.Fatalf("status --keys %s --json: %v\n%v", gate, err, run)
				}
				return doc
			}
			for _, tc := range []struct {
				gate, busy string
				full       bool
			}{
				{"quota:" + quota, "hot", true},
				{quota, "hot", true}, // the bare name
				{"fair:" + fair, "big", false},
			} {
				doc := status(tc.gate)
				if len(doc.Keys) == 0 || doc.Keys[0].Key != tc.busy {
					t.Errorf("status --keys %s: %+v, want %s first", tc.gate, doc.Keys, tc.busy)
					continue
				}
				busy := doc.Keys[0]
				if busy.Waiting == nil || *busy.Waiting == 0 || busy.Throttled == 0 || (tc.full && busy.CanAdmit) {
					t.Errorf("status --keys %s: %s %+v, want tasks waiting, throttled (and not admitting: %v)", tc.gate, busy.Key, busy, tc.full)
					continue
				}
				t.Logf("%s: %s waiting %d, throttled %d in the last minute; then %d other keys", tc.gate, busy.Key, *busy.Waiting, busy.Throttled, len(doc.Keys)-1)
				for _, other := range doc.Keys[1:] {
					if other.Throttled != 0 || other.Key == busy.Key {
						t.Errorf("status --keys %s: %+v listed after %s, want no other key throttled", tc.gate, other, busy.Key)
					}
				}
			}
			table := runEnqueue(t, redistest.Addr(t), nil, "--config", path, "status", "--keys", "quota:"+quota, "--top", "1")
			if table.code != 0 || !strings.Contains(table.stdout, "hot") || strings.Count(table.stdout, "\n") != 3 {
				t.Errorf("status --keys --top 1: want a table with hot alone\n%v", table)
			}
			if bad := runEnqueue(t, redistest.Addr(t), nil, "--config", path, "status", "--keys", "drain:"+keyed); bad.code != 2 || !strings.Contains(bad.stderr, "not a keyed gate") {
				t.Errorf("status --keys of an unkeyed gate: want exit 2 naming the problem\n%v", bad)
			}
			r.finish(t, 130, 30*time.Second, fair, keyed)
		})
	}
}
