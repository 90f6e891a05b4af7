package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/go-redis/redis_rate/v10"
	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/internal/testkit"
	"github.com/sluicehq/sluice/throttle"
)

// The callgrind section counts the instructions redis-server spends per
// decision: deterministic where decisions per second move with the
// machine's load. It starts a redis-server of its own under valgrind's
// callgrind, runs callgrindDecisions calls of each contender one after
// another (one round trip each), and reads callgrind's totals for them.
const (
	callgrindDecisions = 1000
	callgrindWarmUp    = 50
)

// callgrindSpec is every algorithm's limit: 10 per second, so that at one
// decision every 100 ms of the stepped clock every call is admitted and
// writes, a sliding log holds 10 events a window, and a sliding counter has
// one event in each of its 10 sub-windows.
func callgrindSpec(a throttle.Algorithm) throttle.Spec {
	return throttle.Spec{Algorithm: a, Limit: 10, Period: time.Second, Burst: 10, Windows: 10}
}

// callgrindPeerLimit admits every call: redis_rate cannot take a clock, and
// a refusal skips its SET, which would make it look cheaper than it is.
var callgrindPeerLimit = redis_rate.Limit{Rate: 1_000_000, Burst: 1_000_000, Period: time.Second}

// cgServer is a redis-server running under callgrind.
type cgServer struct {
	cmd  *exec.Cmd
	dir  string
	rdb  *redis.Client
	dump int // dumps taken so far: callgrind names the k-th <out>.k
}

func runCallgrind(ctx context.Context, b *bench) error {
	for _, tool := range []string{"valgrind", "callgrind_control", "callgrind_annotate"} {
		if _, err := exec.LookPath(tool); err != nil {
			b.progress("callgrind: %s is not installed: section skipped (scripts/callgrind.sh installs valgrind and runs it)", tool)
			fmt.Fprintf(b.out, "### throttle: instructions per decision (callgrind)\n\nNot measured: %s is not installed here; `scripts/callgrind.sh` installs valgrind and runs this section.\n\n", tool)
			return nil
		}
	}
	s, err := startCallgrind(ctx, b)
	if err != nil {
		return err
	}
	defer s.stop()

	type contender struct {
		name   string
		decide func(ctx context.Context, i int) error
	}
	var contenders []contender
	contenders = append(contenders, contender{"PING (the baseline)", func(ctx context.Context, _ int) error {
		return s.rdb.Ping(ctx).Err()
	}})
	clock := &steppedClock{now: time.Unix(1_800_000_000, 0)}
	step := func(i int) { clock.now = time.Unix(1_800_000_000, 0).Add(time.Duration(i) * 100 * time.Millisecond) }
	for _, a := range throttle.Algorithms {
		lim, err := throttle.New(s.rdb, callgrindSpec(a), throttle.WithClock(clock), throttle.WithPrefix(b.runID+":cg:"+string(a)+":"), throttle.WithPipelining(0))
		if err != nil {
			return fmt.Errorf("throttle.New(%s): %w", a, err)
		}
		contenders = append(contenders, contender{string(a) + " AllowN", func(ctx context.Context, i int) error {
			step(i)
			d, err := lim.AllowN(ctx, "k", 1)
			if err == nil && !d.Allowed {
				err = errors.New("denied, want every call admitted")
			}
			return err
		}})
	}
	// The buckets again on Redis's clock, as redis_rate runs: TIME read by
	// the script, at redis_rate's limit, so that every call is admitted.
	for _, a := range []throttle.Algorithm{throttle.TokenBucket, throttle.LeakyBucket} {
		lim, err := throttle.New(s.rdb, throttle.Spec{Algorithm: a, Limit: callgrindPeerLimit.Rate, Period: callgrindPeerLimit.Period, Burst: callgrindPeerLimit.Burst},
			throttle.WithPrefix(b.runID+":cg:time:"+string(a)+":"), throttle.WithPipelining(0))
		if err != nil {
			return fmt.Errorf("throttle.New(%s): %w", a, err)
		}
		contenders = append(contenders, contender{string(a) + " AllowN, Redis TIME", func(ctx context.Context, _ int) error {
			d, err := lim.AllowN(ctx, "k", 1)
			if err == nil && !d.Allowed {
				err = errors.New("denied, want every call admitted")
			}
			return err
		}})
	}
	drain, err := throttle.New(s.rdb, throttle.Spec{Algorithm: throttle.TokenBucket, Limit: 10, Period: time.Second, Burst: 1}, throttle.WithClock(clock), throttle.WithPrefix(b.runID+":cg:drain:"), throttle.WithPipelining(0))
	if err != nil {
		return err
	}
	quota, err := throttle.New(s.rdb, callgrindSpec(throttle.TokenBucket), throttle.WithClock(clock), throttle.WithPrefix(b.runID+":cg:quota:"), throttle.WithPipelining(0))
	if err != nil {
		return err
	}
	contenders = append(contenders, contender{"Book: drain + quota (token buckets, one slot)", func(ctx context.Context, i int) error {
		step(i)
		bk, err := throttle.Book(ctx, []throttle.Claim{{Limiter: drain, Key: "q", N: 1}, {Limiter: quota, Key: "q", N: 1}}, clock.now, 0)
		if err == nil && !bk.OK {
			err = errors.New("not booked, want every call booked")
		}
		return err
	}})
	peer := redis_rate.NewLimiter(s.rdb)
	contenders = append(contenders, contender{redisRateName + " Allow", func(ctx context.Context, _ int) error {
		r, err := peer.Allow(ctx, b.runID+":cg:redis_rate", callgrindPeerLimit)
		if err == nil && r.Allowed == 0 {
			err = errors.New("denied, want every call admitted")
		}
		return err
	}})

	type figures struct{ total, call float64 }
	results := make([]figures, len(contenders))
	for k, c := range contenders {
		b.progress("callgrind: %s: %d calls", c.name, callgrindDecisions)
		for i := range callgrindWarmUp {
			if err := c.decide(ctx, i); err != nil {
				return fmt.Errorf("%s, warm-up call %d: %w", c.name, i+1, err)
			}
		}
		if err := s.control(ctx, "-z"); err != nil {
			return err
		}
		for i := range callgrindDecisions {
			if err := c.decide(ctx, callgrindWarmUp+i); err != nil {
				return fmt.Errorf("%s, call %d: %w", c.name, i+1, err)
			}
		}
		total, call, err := s.dumpTotals(ctx)
		if err != nil {
			return fmt.Errorf("%s: %w", c.name, err)
		}
		results[k] = figures{total / callgrindDecisions, call / callgrindDecisions}
	}

	w := b.out
	base := results[0]
	peerCost := results[len(results)-1].total - base.total
	fmt.Fprintf(w, "### throttle: instructions per decision (callgrind)\n\n")
	fmt.Fprintf(w, "redis-server under `valgrind --tool=callgrind`, %d calls of each contender one after another (one round trip each, after %d to warm up), counted from zero to a dump. "+
		"Per call: all the server's instructions less a PING's (the network and the event loop), and those in `call()`, the command itself. "+
		"The algorithms run Limit 10 per 1s, Burst 10, Windows 10 on an injected clock one call every 100 ms, so every call is admitted and writes (a sliding log holds 10 events, a sliding counter 10 sub-windows); "+
		"the Book is a drain (token bucket 10/s, burst 1) and a quota (token bucket 10/s, burst 10) on one hash tag, one script run. "+
		"redis_rate reads Redis TIME (ours take the injected clock in ARGV), at a limit of 1,000,000/s so that it admits every call too; the rows \"Redis TIME\" run the buckets as redis_rate runs, on Redis's clock at its limit.\n\n",
		callgrindDecisions, callgrindWarmUp)
	fmt.Fprintln(w, "| contender | instructions per call, less a PING's | in call() | ratio to redis_rate |")
	fmt.Fprintln(w, "|---|--:|--:|--:|")
	for k, c := range contenders {
		r := results[k]
		if k == 0 {
			fmt.Fprintf(w, "| %s | %s (all of it) | %s | — |\n", c.name, grouped(r.total), grouped(r.call))
			continue
		}
		fmt.Fprintf(w, "| %s | %s | %s | %.2f |\n", c.name, grouped(r.total-base.total), grouped(r.call), (r.total-base.total)/peerCost)
	}
	// The Book against one AllowN: redis_rate's, and ours of the same algorithm.
	book, single := results[len(results)-2].total-base.total, results[1+slices.Index(throttle.Algorithms, throttle.TokenBucket)].total-base.total
	fmt.Fprintf(w, "\nThe Book of two claims: %.2f times redis_rate's Allow, %.2f times a token_bucket AllowN.\n\n", book/peerCost, book/single)
	return nil
}

// startCallgrind starts redis-server under callgrind on a free port, with
// no persistence and its cron at 1 Hz (less of it in the counts).
func startCallgrind(ctx context.Context, b *bench) (*cgServer, error) {
	server := os.Getenv("SLUICE_TEST_REDIS_SERVER")
	if server == "" {
		server = "redis-server"
	}
	port, _, err := testkit.ReservePort()
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "sluice-callgrind-")
	if err != nil {
		return nil, err
	}
	cmd := exec.Command("valgrind", "--tool=callgrind", "--callgrind-out-file="+filepath.Join(dir, "callgrind.out"),
		server, "--port", strconv.Itoa(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--hz", "1", "--dir", dir)
	var log bytes.Buffer
	cmd.Stdout, cmd.Stderr = &log, &log
	if err := cmd.Start(); err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("valgrind %s: %w", server, err)
	}
	s := &cgServer{cmd: cmd, dir: dir, rdb: redis.NewClient(&redis.Options{Addr: fmt.Sprintf("127.0.0.1:%d", port), MaxRetries: -1})}
	b.progress("callgrind: %s under valgrind on port %d (output in %s)", server, port, dir)
	deadline := time.Now().Add(60 * time.Second)
	// Dialled by hand until it listens: go-redis would log every refusal.
	for {
		if c, err := net.DialTimeout("tcp", s.rdb.Options().Addr, time.Second); err == nil {
			c.Close()
			if s.rdb.Ping(ctx).Err() == nil {
				break
			}
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			s.stop()
			return nil, fmt.Errorf("redis-server under valgrind did not answer PING within 60 s: %s", log.String())
		}
		time.Sleep(200 * time.Millisecond)
	}
	return s, nil
}

func (s *cgServer) stop() {
	s.rdb.Close()
	_ = s.cmd.Process.Kill()
	_ = s.cmd.Wait()
	if os.Getenv("SLUICE_CALLGRIND_KEEP") != "" {
		fmt.Fprintf(os.Stderr, "callgrind: output kept in %s (SLUICE_CALLGRIND_KEEP)\n", s.dir)
		return
	}
	os.RemoveAll(s.dir)
}

// control sends callgrind_control a command for the server.
func (s *cgServer) control(ctx context.Context, arg string) error {
	out, err := exec.CommandContext(ctx, "callgrind_control", arg, strconv.Itoa(s.cmd.Process.Pid)).CombinedOutput()
	if err != nil {
		return fmt.Errorf("callgrind_control %s: %w: %s", arg, err, out)
	}
	return nil
}

var (
	programTotals = regexp.MustCompile(`(?m)^\s*([\d,]+)\s+\(?[^)]*\)?\s*PROGRAM TOTALS`)
	callInclusive = regexp.MustCompile(`(?m)^\s*([\d,]+)\s+\([^)]*\)\s+\S*:call \[`)
)

// dumpTotals dumps the counts since the last zero and returns all the
// instructions and those in call() (inclusive).
func (s *cgServer) dumpTotals(ctx context.Context) (total, call float64, err error) {
	if err := s.control(ctx, "-d"); err != nil {
		return 0, 0, err
	}
	s.dump++
	out, err := exec.CommandContext(ctx, "callgrind_annotate", "--inclusive=yes", fmt.Sprintf("%s.%d", filepath.Join(s.dir, "callgrind.out"), s.dump)).Output()
	if err != nil {
		return 0, 0, fmt.Errorf("callgrind_annotate: %w", err)
	}
	num := func(re *regexp.Regexp, what string) (float64, error) {
		m := re.FindSubmatch(out)
		if m == nil {
			return 0, fmt.Errorf("callgrind_annotate printed no %s", what)
		}
		return strconv.ParseFloat(strings.ReplaceAll(string(m[1]), ",", ""), 64)
	}
	if total, err = num(programTotals, "PROGRAM TOTALS"); err != nil {
		return 0, 0, err
	}
	if call, err = num(callInclusive, "line for call()"); err != nil {
		return 0, 0, err
	}
	return total, call, nil
}
