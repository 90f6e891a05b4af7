// Package version tells which build of sluice is running, from the build
// information the Go toolchain writes into every binary, for the commands'
// --version.
package version

import (
	"fmt"
	"runtime/debug"
)

// String is the main module's path and version, the VCS revision the
// binary was built from (with "+dirty" when the work tree had uncommitted
// changes) and its time, and the Go version:
//
//	github.com/sluicehq/sluice v1.2.0 (revision 57529a5c1f9e+dirty, 2026-11-30T02:28:19Z; go1.26.0)
//
// A binary built without VCS stamping (go build -buildvcs=false, or outside
// a repository) says "revision unknown"; one built by `go build` in the
// repository has version "(devel)", as the toolchain sets it.
func String() string {
	info, ok := debug.ReadBuildInfo()
	if !ok {
		return "sluice (no build information)"
	}
	return describe(info)
}

func describe(info *debug.BuildInfo) string {
	settings := map[string]string{}
	for _, s := range info.Settings {
		settings[s.Key] = s.Value
	}
	revision := "revision unknown"
	if r := settings["vcs.revision"]; r != "" {
		revision = "revision " + r[:min(len(r), 12)]
		if settings["vcs.modified"] == "true" {
			revision += "+dirty"
		}
		if at := settings["vcs.time"]; at != "" {
			revision += ", " + at
		}
	}
	version := info.Main.Version
	if version == "" {
		version = "(devel)"
	}
	return fmt.Sprintf("%s %s (%s; %s)", info.Main.Path, version, revision, info.GoVersion)
}
