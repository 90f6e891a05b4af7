// Package lua holds sluice's Redis scripts, one per rate-limit algorithm.
//
// Each exported string is a complete script: the shared prelude
// (prelude.lua: clock, exact integer division, TTL) followed by the
// algorithm's body. Every script takes the same ARGV, so one caller runs
// them all:
//
//	ARGV[1] now in µs since the Unix epoch, or "" to read Redis TIME
//	ARGV[2] limit: events per period
//	ARGV[3] period in µs
//	ARGV[4] burst: bucket capacity in events (buckets only)
//	ARGV[5] windows: sub-windows per period (sliding_counter only)
//	ARGV[6] n: events asked for, 1 <= n
//	ARGV[7] TTL slack in µs, added to every TTL the script sets
//
// and answers {allowed (1|0), remaining, retry_after µs, reset_after µs}.
package lua

import (
	"embed"
	"fmt"
)

//go:embed *.lua
var files embed.FS

// The scripts, one per algorithm.
var (
	FixedWindow    = script("fixed_window.lua")
	SlidingLog     = script("sliding_log.lua")
	SlidingCounter = script("sliding_counter.lua")
	TokenBucket    = script("token_bucket.lua")
	LeakyBucket    = script("leaky_bucket.lua")
)

func script(name string) string {
	prelude, err := files.ReadFile("prelude.lua")
	if err != nil {
		panic(fmt.Sprintf("lua: prelude.lua is not embedded: %v", err))
	}
	body, err := files.ReadFile(name)
	if err != nil {
		panic(fmt.Sprintf("lua: %s is not embedded: %v", name, err))
	}
	return string(prelude) + "\n" + string(body)
}
