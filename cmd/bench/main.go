// Command bench measures sluice against its peers on a real redis-server and
// prints Markdown tables for docs/benchmarks.md (progress goes to stderr).
//
//	scripts/redis-env.sh go run ./cmd/bench            # what `make bench` runs
//	go run ./cmd/bench -addr 127.0.0.1:6379 -only throttle -duration 5s
//
// The output is a list of sections, each a few tables with a note on what was
// measured. Every throughput figure is the median of -rounds rounds, and in
// each round every contender runs for -duration in turn, so a machine that
// slows down part-way hurts all of them alike. The worker sections, whose
// runs are a few seconds of tasks each, take -worker-rounds rounds and give
// each ratio as the median of the rounds' own ratios. Peers are measured in the same
// run on the same server: compare rows within a table, not across machines.
// Client, server and redis-benchmark share the machine's CPUs (see the
// header), so absolute rates say more about the machine than about sluice.
package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"os"
	"os/signal"
	"runtime"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
	"golang.org/x/text/language"
	"golang.org/x/text/message"
)

// section is one part of the output. Add new ones to sections.
type section struct {
	name string
	run  func(ctx context.Context, b *bench) error
}

var sections = []section{
	{"throttle", runThrottle},
	{"callgrind", runCallgrind},
	{"worker", runWorker},
	{"keyed", runKeyed},
	{"enqueue", runEnqueue},
	{"intake", runIntake},
	{"rate", runRate},
	{"backlog", runBacklog},
	{"fleet", runFleet},
	{"plan", runPlan},
	{"page", runPage},
	{"adaptive", runAdaptive},
}

// bench is what every section gets: the server, the settings, and a run id
// that every key the run creates contains, so that cleanup finds them all.
type bench struct {
	rdb      *redis.Client
	addr     string
	duration time.Duration
	rounds   int
	// workerRounds is rounds for the worker sections: their runs are
	// short and this machine's speed drifts, so they take more.
	workerRounds int
	runID        string
	out          io.Writer // the Markdown
}

// progress tells the person waiting what is happening, on stderr.
func (b *bench) progress(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "bench: "+format+"\n", args...)
}

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

func run() error {
	var names []string
	for _, s := range sections {
		names = append(names, s.name)
	}
	addr := flag.String("addr", os.Getenv("SLUICE_TEST_REDIS_ADDR"), "redis-server `host:port` (default $SLUICE_TEST_REDIS_ADDR)")
	duration := flag.Duration("duration", 2*time.Second, "length of one measurement")
	rounds := flag.Int("rounds", 3, "rounds per contender; the median is reported")
	workerRounds := flag.Int("worker-rounds", 7, "rounds for the sections worker and keyed, whose runs are short")
	only := flag.String("only", "", "run only the section `NAME`, one of "+strings.Join(names, ", "))
	cpuProfile := flag.String("cpuprofile", "", "write a CPU profile of the run to `FILE`")
	flag.Parse()
	if *cpuProfile != "" {
		f, err := os.Create(*cpuProfile)
		if err != nil {
			return err
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			return err
		}
		defer pprof.StopCPUProfile()
	}

	switch {
	case flag.NArg() > 0:
		return fmt.Errorf("unexpected arguments %q: all settings are flags", flag.Args())
	case *addr == "":
		return errors.New("no Redis address: pass -addr host:port or run under scripts/redis-env.sh, which sets SLUICE_TEST_REDIS_ADDR")
	case *duration <= 0:
		return fmt.Errorf("-duration must be > 0, got %v", *duration)
	case *rounds < 1:
		return fmt.Errorf("-rounds must be >= 1, got %d", *rounds)
	case *workerRounds < 1:
		return fmt.Errorf("-worker-rounds must be >= 1, got %d", *workerRounds)
	case *only != "" && !slices.Contains(names, *only):
		return fmt.Errorf("-only %q: no such section; sections are %s", *only, strings.Join(names, ", "))
	}

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()

	rdb := redis.NewClient(&redis.Options{Addr: *addr, PoolSize: throttleConcurrency})
	defer rdb.Close()
	info, err := rdb.Info(ctx, "server").Result()
	if err != nil {
		return fmt.Errorf("INFO server on %s: %w", *addr, err)
	}
	id := make([]byte, 4)
	rand.Read(id)
	b := &bench{rdb: rdb, addr: *addr, duration: *duration, rounds: *rounds, workerRounds: *workerRounds, runID: "bench-" + hex.EncodeToString(id), out: os.Stdout}
	defer b.deleteKeys()

	printHeader(b.out, infoField(info, "redis_version"))
	for _, s := range sections {
		if *only != "" && s.name != *only {
			continue
		}
		b.progress("section %s", s.name)
		if err := s.run(ctx, b); err != nil {
			return fmt.Errorf("section %s: %w", s.name, err)
		}
	}
	return nil
}

func printHeader(w io.Writer, redisVersion string) {
	args := []string{"go", "run", "./cmd/bench"}
	for _, a := range os.Args[1:] {
		if a == "" || strings.ContainsAny(a, " \t'\"$`\\") {
			a = strconv.Quote(a)
		}
		args = append(args, a)
	}
	fmt.Fprintf(w, "## Benchmarks\n\n")
	fmt.Fprintf(w, "- date: %s\n", time.Now().UTC().Format("2006-01-02 15:04 MST"))
	fmt.Fprintf(w, "- command: `%s`\n", strings.Join(args, " "))
	fmt.Fprintf(w, "- Go: %s %s/%s, GOMAXPROCS %d, %d CPUs\n", runtime.Version(), runtime.GOOS, runtime.GOARCH, runtime.GOMAXPROCS(0), runtime.NumCPU())
	fmt.Fprintf(w, "- redis-server: %s, standalone\n\n", redisVersion)
}

// infoField returns the value of name in an INFO reply, or "unknown".
func infoField(info, name string) string {
	for line := range strings.Lines(info) {
		if v, ok := strings.CutPrefix(line, name+":"); ok {
			return strings.TrimSpace(v)
		}
	}
	return "unknown"
}

// deleteKeys removes every key this run created: they all contain b.runID.
// It runs after an interrupt too, so it does not use the run's context.
func (b *bench) deleteKeys() { b.deleteMatching("*" + b.runID + "*") }

// deleteMatching removes every key that matches pattern.
func (b *bench) deleteMatching(pattern string) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var deleted int64
	var cursor uint64
	for {
		keys, next, err := b.rdb.Scan(ctx, cursor, pattern, 1000).Result()
		if err != nil {
			b.progress("cleanup: SCAN for keys %s: %v (delete them by hand)", pattern, err)
			return
		}
		if len(keys) > 0 {
			n, err := b.rdb.Unlink(ctx, keys...).Result()
			if err != nil {
				b.progress("cleanup: UNLINK keys %s: %v (delete them by hand)", pattern, err)
				return
			}
			deleted += n
		}
		if next == 0 {
			break
		}
		cursor = next
	}
	b.progress("cleanup: deleted %d keys %s", deleted, pattern)
}

// grouped formats x rounded to an integer with thousands separators: 41,230.
func grouped(x float64) string {
	return message.NewPrinter(language.English).Sprintf("%d", int64(math.Round(x)))
}

// recorder is a go-redis hook that keeps the last script call (FCALL,
// EVALSHA or EVAL) its client sent, so that a section can replay or inspect exactly
// what a library sends instead of restating the library's calling
// convention.
type recorder struct{ last []any }

func (r *recorder) DialHook(next redis.DialHook) redis.DialHook { return next }

func (r *recorder) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

func (r *recorder) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if name := cmd.Name(); name == "fcall" || name == "evalsha" || name == "eval" {
			r.last = cmd.Args()
		}
		return next(ctx, cmd)
	}
}

// lastScriptCall returns the words of the last script call and its first
// key.
func (r *recorder) lastScriptCall() (words []string, key string, err error) {
	for _, arg := range r.last {
		words = append(words, fmt.Sprint(arg))
	}
	if len(words) < 4 {
		return nil, "", fmt.Errorf("the last script call sent was %q, want FCALL, EVALSHA or EVAL with a key", words)
	}
	return words, words[3], nil
}

// recordingClient returns a client of its own for b's server and the
// recorder of its commands. The caller closes the client.
func (b *bench) recordingClient() (*redis.Client, *recorder) {
	rdb := redis.NewClient(&redis.Options{Addr: b.addr})
	rec := &recorder{}
	rdb.AddHook(rec)
	return rdb, rec
}
