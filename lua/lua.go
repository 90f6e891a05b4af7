// Package lua holds sluice's Redis scripts: Book, the one script of every
// rate limit; the fleet-wide semaphore; Wake, which brings waiting tasks
// back on time, and Ready, which puts them at the head of their queue.
//
// Book is common.lua (clock, exact integer division), one constructor per
// kind of state (counter.lua: fixed_window and sliding_counter;
// sliding_log.lua; bucket.lua: token_bucket and leaky_bucket), and the
// driver, book.lua, which runs one operation on several limits at once
// (book, cancel, block or peek) and documents the KEYS and ARGV it takes.
// Each constructor mirrors its Go twin in package algorithms.
package lua

import (
	"embed"
	"fmt"
)

//go:embed *.lua
var files embed.FS

// Book runs an operation on the limits of one cluster slot (see book.lua).
var Book = join("common.lua", "counter.lua", "sliding_log.lua", "bucket.lua", "book.lua")

// Semaphore is the fleet-wide concurrency limit (see semaphore.lua).
var Semaphore = join("common.lua", "semaphore.lua")

// Wake takes the tasks of a queue that are due back from their wait (see
// wake.lua).
var Wake = join("common.lua", "wake.lua")

// Ready moves tasks back from waiting to the head of their queue (see
// ready.lua).
var Ready = join("ready.lua")

func join(names ...string) string {
	var s string
	for _, name := range names {
		b, err := files.ReadFile(name)
		if err != nil {
			panic(fmt.Sprintf("lua: %s is not embedded: %v", name, err))
		}
		s += string(b) + "\n"
	}
	return s
}
