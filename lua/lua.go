// Package lua holds sluice's Redis scripts: one per rate-limit algorithm,
// and the fleet-wide semaphore.
//
// Each rate-limit script is common.lua (clock, exact integer division),
// limiter.lua (the arguments below, TTL), the algorithm's body
// (its state, and decide, record and give_back on it), and the shared
// epilogue (epilogue.lua: allow, reserve, cancel or block with those). Every
// script takes the same KEYS and ARGV, so one caller runs them all:
//
//	KEYS[1] the key's state
//	KEYS[2] where sliding_log keeps the key's block (the others keep it in
//	        their state); in the same cluster slot as KEYS[1]
//	ARGV[1] now in µs since the Unix epoch, or "" to read Redis TIME
//	ARGV[2] limit: events per period
//	ARGV[3] period in µs
//	ARGV[4] burst: bucket capacity in events (buckets only)
//	ARGV[5] windows: sub-windows per period (sliding_counter only)
//	ARGV[6] n: events asked for, 1 <= n <= capacity
//	ARGV[7] TTL slack in µs, added to every TTL the script sets
//	ARGV[8] op: allow, reserve, cancel or block
//	ARGV[9] reserve: the longest wait in µs; cancel: the reservation's at;
//	        block: for how many µs
//	ARGV[10] the earliest instant to count at in µs (0 for allow)
//
// and answers {allowed (1|0), remaining, retry_after, reset_after, delay, at}
// (times in µs; see epilogue.lua).
package lua

import (
	"embed"
	"fmt"
)

//go:embed *.lua
var files embed.FS

// The rate-limit scripts, one per algorithm.
var (
	FixedWindow    = script("fixed_window.lua")
	SlidingLog     = script("sliding_log.lua")
	SlidingCounter = script("sliding_counter.lua")
	TokenBucket    = script("token_bucket.lua")
	LeakyBucket    = script("leaky_bucket.lua")
)

// Semaphore is the fleet-wide concurrency limit (see semaphore.lua).
var Semaphore = read("common.lua") + "\n" + read("semaphore.lua")

func script(body string) string {
	return read("common.lua") + "\n" + read("limiter.lua") + "\n" + read(body) + read("epilogue.lua")
}

func read(name string) string {
	b, err := files.ReadFile(name)
	if err != nil {
		panic(fmt.Sprintf("lua: %s is not embedded: %v", name, err))
	}
	return string(b)
}
