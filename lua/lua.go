// Package lua holds sluice's Redis scripts: Book, the one script of every
// rate limit; the fleet-wide semaphore; Wake, which brings waiting tasks
// back on time, and Ready, which puts them at the head of their queue.
//
// Book is common.lua (clock, exact integer division), one constructor per
// kind of state (counter.lua: fixed_window and sliding_counter;
// sliding_log.lua; bucket.lua: token_bucket and leaky_bucket; fair.lua:
// a queue's fair shares, which wake.lua shares), and the
// driver, book.lua, which runs one operation on several limits at once
// (book, cancel, block or peek) and documents the KEYS and ARGV it takes.
// Each constructor mirrors its Go twin in package algorithms. Allow is
// one limit's AllowN or ReserveN per algorithm, with only that algorithm's
// code and its quick decision (allow.lua); BookLibrary holds Book and
// Allow as Redis 7 functions, defined once when loaded.
package lua

import (
	"embed"
	"fmt"
)

//go:embed *.lua
var files embed.FS

// bookParts are the pieces of Book before its driver.
var bookParts = []string{"common.lua", "counter.lua", "sliding_log.lua", "bucket.lua", "fair.lua"}

// Book runs an operation on the limits of one cluster slot (see book.lua).
var Book = join(append(bookParts, "book.lua")...)

// BookLibrary is Book as a Redis 7 function library named name whose one
// function, also name, runs Book with the same KEYS and ARGV: loaded once
// (FUNCTION LOAD), its functions are defined once, where EVAL and EVALSHA
// define every function of the script again on every call. Scripts read
// KEYS and ARGV as globals, which a function may not: the library holds
// them as locals, set by each call.
//
// Its second function, name + "_allow", runs Allow's script of the
// sliding algorithm its ARGV[2] names; its third, name + "_bucket",
// Allow's script of the buckets, name + "_window" the fixed window's
// (allow_window.lua) and name + "_counter" the sliding counter's
// (allow_counter.lua); its last, name + "_book_buckets", Book
// on two buckets of one slot with nothing else asked
// (book_buckets.lua), which has no script.
func BookLibrary(name string) string {
	return "#!lua name=" + name + "\nlocal KEYS, ARGV\n" + join(bookParts...) + join("allow_limit.lua") +
		"local function book()\n" + join("book.lua") + "end\n" +
		"local function allow(new_limit, fast_limit)\n" + join("allow.lua") + "end\n" +
		"local function allow_bucket()\n" + join("allow_bucket.lua") + "end\n" +
		"local allow_constructors = {sliding_log = new_sliding_log}\n" +
		"local allow_fast = {sliding_log = sliding_log_allow}\n" +
		"redis.register_function('" + name + "', function(keys, args)\n  KEYS, ARGV = keys, args\n  return book()\nend)\n" +
		"redis.register_function('" + name + "_allow', function(keys, args)\n  KEYS, ARGV = keys, args\n  return allow(allow_constructors[args[2]], allow_fast[args[2]])\nend)\n" +
		"redis.register_function('" + name + "_bucket', function(keys, args)\n  KEYS, ARGV = keys, args\n  return allow_bucket()\nend)\n" +
		"local function allow_window()\n" + join("allow_window.lua") + "end\n" +
		"redis.register_function('" + name + "_window', function(keys, args)\n  KEYS, ARGV = keys, args\n  return allow_window()\nend)\n" +
		"local function allow_counter()\n" + join("allow_counter.lua") + "end\n" +
		"redis.register_function('" + name + "_counter', function(keys, args)\n  KEYS, ARGV = keys, args\n  return allow_counter()\nend)\n" +
		join("book_buckets_slow.lua") + "local function book_buckets()\n" + join("book_buckets.lua") + "end\n" +
		"redis.register_function('" + name + "_book_buckets', function(keys, args)\n  KEYS, ARGV = keys, args\n  return book_buckets()\nend)\n"
}

// Semaphore is the fleet-wide concurrency limit (see semaphore.lua).
var Semaphore = join("common.lua", "semaphore.lua")

// Wake takes the tasks of a queue that are due back from their wait (see
// wake.lua).
var Wake = join("common.lua", "fair.lua", "wake.lua")

// Ready moves tasks back from waiting to the head of their queue (see
// ready.lua).
var Ready = join("ready.lua")

// Allow is the script of one limit's AllowN or ReserveN (see allow.lua)
// for each algorithm, holding only that algorithm's code.
var Allow = map[string]string{
	"fixed_window":    join("common.lua", "counter.lua", "allow_limit.lua", "allow_window.lua"),
	"sliding_counter": join("common.lua", "counter.lua", "allow_limit.lua", "allow_counter.lua"),
	"sliding_log":     allowOf("new_sliding_log", "sliding_log_allow", "sliding_log.lua"),
	"token_bucket":    allowBucket,
	"leaky_bucket":    allowBucket,
}

// allowBucket is the buckets' Allow (see allow_bucket.lua): its KEYS and
// ARGV are not allow.lua's.
var allowBucket = join("common.lua", "bucket.lua", "allow_limit.lua", "allow_bucket.lua")

func allowOf(constructor, fast, file string) string {
	return join("common.lua", file, "allow_limit.lua") + "local new_limit, fast_limit = " + constructor + ", " + fast + "\n" + join("allow.lua")
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
