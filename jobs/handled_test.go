package jobs_test

import (
	"strings"
	"testing"

	"github.com/sluicehq/sluice/jobs"
)

// TestCheckHandled: a handled type with no tasks: entry while an entry no
// handler takes is near it is a typo, named with both; an entry no handler
// takes is reported with the nearest handled name; what matches (a type,
// or a prefix pattern as asynq's mux matches it) is not reported.
func TestCheckHandled(t *testing.T) {
	tasks := func(types ...string) jobs.Config {
		cfg := jobs.Config{Tasks: map[string]jobs.TaskConfig{}}
		for _, typ := range types {
			cfg.Tasks[typ] = jobs.TaskConfig{}
		}
		return cfg
	}
	for _, tc := range []struct {
		desc     string
		cfg      jobs.Config
		patterns []string
		want     []string // each problem's "key: problem", in part; "typo " first for a typo
	}{
		{desc: "all handled", cfg: tasks("crm:sync", "email:send"), patterns: []string{"crm:sync", "email:"}},
		{desc: "a handled type with no entry and no near one is usual", cfg: tasks("crm:sync"), patterns: []string{"crm:sync", "demo:noop"}},
		{desc: "typo under tasks", cfg: tasks("crm:synk"), patterns: []string{"crm:sync"},
			want: []string{`typo tasks.crm:sync: this worker handles "crm:sync", which has no entry under tasks:, so it runs with none of its limits (quotas, cost, concurrency); tasks.crm:synk is near it and no handler of this worker takes it: is one of them a typo? (If not, give "crm:sync" an entry of its own under tasks:, even an empty one.)`}},
		{desc: "an entry another worker may handle", cfg: tasks("crm:sync", "pdf:render"), patterns: []string{"crm:sync"},
			want: []string{`tasks.pdf:render: no handler of this worker takes "pdf:render" (it handles crm:sync); its limits apply only if another worker of the fleet handles it`}},
		{desc: "an entry near a handled type that has its own entry", cfg: tasks("crm:sync", "crm:synk"), patterns: []string{"crm:sync"},
			want: []string{`tasks.crm:synk: no handler of this worker takes "crm:synk"; the nearest it handles is "crm:sync"`}},
		{desc: "short names are not near", cfg: tasks("ab"), patterns: []string{"cd"},
			want: []string{`tasks.ab: no handler of this worker takes "ab" (it handles cd)`}},
	} {
		t.Run(tc.desc, func(t *testing.T) {
			got := jobs.CheckHandled(tc.cfg, tc.patterns)
			if len(got) != len(tc.want) {
				t.Fatalf("CheckHandled = %v, want %d problems: %q", got, len(tc.want), tc.want)
			}
			for i, p := range got {
				want, typo := strings.CutPrefix(tc.want[i], "typo ")
				if p.Typo != typo || !strings.Contains(p.Error(), want) {
					t.Errorf("problem %d = %q (typo %v), want %q (typo %v)", i, p.Error(), p.Typo, want, typo)
				}
			}
		})
	}
}
