package version

import (
	"runtime/debug"
	"testing"
)

func TestDescribe(t *testing.T) {
	main := debug.Module{Path: "github.com/sluicehq/sluice", Version: "v1.2.0"}
	for _, tt := range []struct {
		desc     string
		settings []debug.BuildSetting
		want     string
	}{
		{desc: "no VCS stamp", want: "github.com/sluicehq/sluice v1.2.0 (revision unknown; go1.26.0)"},
		{desc: "clean tree", settings: []debug.BuildSetting{
			{Key: "vcs.revision", Value: "57529a5c1f9e0123456789abcdef0123456789ab"}, {Key: "vcs.time", Value: "2026-11-30T02:28:19Z"}, {Key: "vcs.modified", Value: "false"}},
			want: "github.com/sluicehq/sluice v1.2.0 (revision 57529a5c1f9e, 2026-11-30T02:28:19Z; go1.26.0)"},
		{desc: "uncommitted changes", settings: []debug.BuildSetting{
			{Key: "vcs.revision", Value: "57529a5c1f9e0123456789abcdef0123456789ab"}, {Key: "vcs.modified", Value: "true"}},
			want: "github.com/sluicehq/sluice v1.2.0 (revision 57529a5c1f9e+dirty; go1.26.0)"},
	} {
		info := &debug.BuildInfo{GoVersion: "go1.26.0", Main: main, Settings: tt.settings}
		if got := describe(info); got != tt.want {
			t.Errorf("%s: describe() = %q, want %q", tt.desc, got, tt.want)
		}
	}
}
