// Command enqueue puts tasks into sluice's queues and shows what the queues
// and workers are doing. It reads the same config.yaml as the workers (and
// the same SLUICE_* environment overrides).
//
//	enqueue [flags] TYPE [PAYLOAD_JSON]       one task (or --count N copies); prints each task id
//	enqueue [flags] --file tasks.jsonl        one task per line; "-" reads stdin
//	enqueue status [--watch] [--json]         queues, gates and live workers
//	enqueue serve [--listen HOST:PORT]        the HTTP intake: POST /v1/tasks
//	enqueue limits list|set|reset|history|import   change limits fleet-wide, live, audited
//	enqueue eta TASK_ID [--queue Q]           when a task is predicted to start
//	enqueue plan [--file F] [--json]          when each queue will be empty, before enqueueing
//	enqueue --version
//	enqueue completion bash|zsh|fish|powershell
//
// Input is checked in full before anything is written: a bad type, payload,
// option or line enqueues nothing. Exit codes: 0 done, 1 Redis failed or
// Ctrl-C cut a load short (what landed and what did not is reported), 2 bad
// input or config (nothing was enqueued).
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/spf13/cobra"
	"golang.org/x/term"

	"github.com/sluicehq/sluice/config"
	"github.com/sluicehq/sluice/internal/cli"
	"github.com/sluicehq/sluice/producer"
)

// Exit codes.
const (
	exitRedis    = 1                // Redis failed or a load was interrupted: some tasks may be missing
	exitBadInput = cli.ExitBadInput // bad arguments, input or config: nothing was enqueued
)

// badInput marks err as the user's to fix; nothing was written.
func badInput(err error) error { return cli.BadInput(err) }

// redisFailed marks err as Redis's failure.
func redisFailed(err error) error { return &cli.ExitError{Code: exitRedis, Err: err} }

func main() {
	redis.SetLogger(quietLog{})
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Stdin, os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// run runs the command line args and returns the exit code.
func run(ctx context.Context, args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	return cli.Execute(ctx, newRootCommand(&app{}), args, stdin, stdout, stderr, func(stderr io.Writer, err error) {
		fmt.Fprintf(stderr, "enqueue: %v\n", err)
	})
}

// app is what the subcommands share.
type app struct {
	configPath string
}

// newRootCommand returns the command tree. The root command enqueues; every
// other subcommand is built in its own file and added here with one
// AddCommand line.
func newRootCommand(a *app) *cobra.Command {
	root := newEnqueueCommand(a)
	root.PersistentFlags().StringVar(&a.configPath, "config", "config.yaml", "the config `file` (SLUICE_* variables override it)")
	cli.Setup(root)
	_ = root.MarkPersistentFlagFilename("config", "yaml", "yml")
	root.AddCommand(newStatusCommand(a))
	root.AddCommand(newServeCommand(a))
	root.AddCommand(newLimitsCommand(a))
	root.AddCommand(newETACommand(a))
	root.AddCommand(newPlanCommand(a))
	return root
}

// loadConfig reads --config; problems with it are bad input, one line each.
func (a *app) loadConfig() (config.File, error) {
	f, err := config.Load(a.configPath)
	var problems *config.Problems
	if errors.As(err, &problems) {
		return f, badInput(problems)
	}
	if err != nil {
		return f, badInput(err)
	}
	return f, nil
}

// connect reads --config and connects to its Redis, for the commands that
// read what is there; the caller closes the client.
func (a *app) connect(cmd *cobra.Command) (config.File, redis.UniversalClient, error) {
	file, err := a.loadConfig()
	if err != nil {
		return file, nil, err
	}
	rdb := file.Redis.Client()
	if err := checkLogin(cmd.Context(), file.Redis, rdb); err != nil {
		rdb.Close()
		return file, nil, err
	}
	return file, rdb, nil
}

// checkQueueFlag checks the queue --queue names; a bad one is bad input.
func checkQueueFlag(queue string) error {
	if err := producer.CheckQueue(queue); err != nil {
		return badInput(fmt.Errorf("--queue: %w", err))
	}
	return nil
}

// newEnqueueClient connects to Redis as r says, for enqueueing: with a
// connection for each of pool goroutines, and without go-redis's retries.
// A retried call hides what became of the first attempt (a reply lost
// after the server ran the script, then "connection refused"), which
// would make the report of what landed wrong; see writeProbe.
func newEnqueueClient(r config.Redis, pool int) redis.UniversalClient {
	return r.ClientWith(func(o *redis.UniversalOptions) {
		o.PoolSize, o.MaxRetries, o.DialerRetries = pool, -1, 1 // -1: no retries
	})
}

// checkLogin fails when Redis refuses rdb for a reason in the config (a
// wrong password or CA): every call after would fail the same way. Redis
// that does not answer is left to the errors of the calls that follow.
func checkLogin(ctx context.Context, r config.Redis, rdb redis.UniversalClient) error {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	var refused *config.RefusedError
	if err := r.Ping(ctx, rdb); errors.As(err, &refused) {
		return redisFailed(err)
	}
	return nil
}

// redisAt names the server(s) r points at, for messages.
func redisAt(r config.Redis) string {
	if len(r.Cluster) > 0 {
		return fmt.Sprintf("the Redis Cluster at %v", r.Cluster)
	}
	return "Redis at " + r.Addr
}

// quietLog drops go-redis's log lines ("failed to dial ..."): enqueue
// reports each failure itself, in its own words.
type quietLog struct{}

func (quietLog) Printf(context.Context, string, ...any) {}

// isTerminal reports whether w is a terminal.
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	return ok && term.IsTerminal(int(f.Fd()))
}
