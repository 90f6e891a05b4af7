// Package lua holds sluice's Redis scripts: Book, the one script of every
// rate limit; the fleet-wide semaphore; Wake, which brings waiting tasks
// back on time, Ready, which puts them at the head of their queue, and
// Park, which moves a backlog's tasks into their lines.
//
// Book is common.lua (clock, exact integer division), one constructor per
// kind of state (counter.lua: fixed_window and sliding_counter;
// sliding_log.lua; bucket.lua: token_bucket and leaky_bucket; fair.lua:
// a queue's fair shares, which wake.lua shares), settle.lua (the
// instant at which every claim's earliest turn agrees), and the
// driver, book.lua, which runs one operation on several limits at once
// (book, cancel, block or peek) and documents the KEYS and ARGV it takes.
// Each constructor mirrors its Go twin in package algorithms. Allow is
// one limit's AllowN or ReserveN per algorithm, with only that algorithm's
// code and its quick decision on the states most calls find
// (allow_*.lua, allow_limit.lua for the rest). Series (series.lua) books
// a turn for each of several IDs, one after another, on the same limits
// in one run, with the same constructors. BookLibrary holds Book, Allow,
// a two-bucket Book (book_buckets.lua) and Series as Redis 7 functions,
// defined once when loaded.
package lua

import (
	"embed"
	"fmt"
)

//go:embed *.lua
var files embed.FS

// bookParts are the pieces of Book before its driver.
var bookParts = []string{"common.lua", "counter.lua", "sliding_log.lua", "bucket.lua", "fair.lua", "settle.lua"}

// Book runs an operation on the limits of one cluster slot (see book.lua).
var Book = join(append(bookParts, "book.lua")...)

// Series books one turn for each of several IDs, one after another, on the
// limits of one cluster slot, in one run (see series.lua): a script of its
// own, so that Book's runs do none of its work.
var Series = join(append(bookParts, "series.lua")...)

// BookLibrary is Book as a Redis 7 function library named name whose
// function name runs Book with the same KEYS and ARGV: loaded once
// (FUNCTION LOAD), its functions are defined once, where EVAL and EVALSHA
// define every function of the script again on every call. Scripts read
// KEYS and ARGV as globals, which a function may not: the library holds
// them as locals, set by each call.
//
// Its other functions run the lean scripts, with their KEYS and ARGV:
// name + "_window", "_counter", "_log" and "_bucket" Allow's of the fixed
// window, the sliding counter, the sliding log and the buckets; name +
// "_book_buckets" a Book on two buckets of one slot with nothing else
// asked (book_buckets.lua), which has no script; name + "_series" runs
// Series.
func BookLibrary(name string) string {
	lib := "#!lua name=" + name + "\nlocal KEYS, ARGV\n" + join(bookParts...) + join("allow_limit.lua") +
		"local function book()\n" + join("book.lua") + "end\n" + join("book_buckets_slow.lua") +
		"local function series()\n" + join("series.lua") + "end\n"
	// A function runs the body defined above (book, series) or its own file's.
	for _, f := range []struct{ suffix, file, body string }{
		{"", "", "book"}, {"_window", "allow_window.lua", ""}, {"_counter", "allow_counter.lua", ""}, {"_log", "allow_log.lua", ""},
		{"_bucket", "allow_bucket.lua", ""}, {"_book_buckets", "book_buckets.lua", ""}, {"_series", "", "series"},
	} {
		body := f.body
		if f.file != "" {
			body = "run" + f.suffix
			lib += "local function " + body + "()\n" + join(f.file) + "end\n"
		}
		lib += "redis.register_function('" + name + f.suffix + "', function(keys, args)\n  KEYS, ARGV = keys, args\n  return " + body + "()\nend)\n"
	}
	return lib
}

// Semaphore is the fleet-wide concurrency limit (see semaphore.lua).
var Semaphore = join("common.lua", "semaphore.lua")

// Wake takes the tasks of a queue that are due back from their wait (see
// wake.lua).
var Wake = join("common.lua", "fair.lua", "wake.lua")

// Ready moves tasks back from waiting to the head of their queue (see
// ready.lua).
var Ready = join("ready.lua")

// Park moves a batch of a queue's pending tasks into their backlog lines
// (see park.lua).
var Park = join("park.lua")

// Adapt is the controller of an adaptive quota's learned rate (see
// adapt.lua).
var Adapt = join("common.lua", "adapt.lua")

// Recent counts events as throttled in a key's recent throttles
// (recent.lua).
var Recent = join("common.lua", "recent.lua")

// Allow is the script of one limit's AllowN or ReserveN for each
// algorithm (see allow_window.lua, allow_counter.lua, allow_log.lua and
// allow_bucket.lua), holding only that algorithm's code, with the fewest
// keys and arguments.
var Allow = map[string]string{
	"fixed_window":    join("common.lua", "counter.lua", "allow_limit.lua", "allow_window.lua"),
	"sliding_counter": join("common.lua", "counter.lua", "allow_limit.lua", "allow_counter.lua"),
	"sliding_log":     join("common.lua", "sliding_log.lua", "allow_limit.lua", "allow_log.lua"),
	"token_bucket":    join("common.lua", "bucket.lua", "allow_limit.lua", "allow_bucket.lua"),
	"leaky_bucket":    join("common.lua", "bucket.lua", "allow_limit.lua", "allow_bucket.lua"),
}

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
