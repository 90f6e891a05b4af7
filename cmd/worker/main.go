// Command worker runs one sluice worker: it consumes the queues of
// config.yaml through asynq, puts every task through its gates (drain,
// quotas, concurrency) and runs the built-in task types' handlers, until
// SIGINT or SIGTERM. It is a thin main over package worker, which runs
// your own handlers the same way.
//
//	worker [--config config.yaml] [--embedded-redis] [--demo N]
//	worker --hash-password < password.txt     prints a bcrypt hash for worker.ui.password_hash
//	worker --version
//	worker completion bash|zsh|fish|powershell
//
// Exit codes: 0 after a graceful stop, 1 when it cannot run, 2 when the
// config or the arguments have problems (one line per problem, naming its
// key).
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"github.com/redis/go-redis/v9"
	"github.com/spf13/cobra"
	"golang.org/x/crypto/bcrypt"

	"github.com/sluicehq/sluice/config"
	"github.com/sluicehq/sluice/internal/cli"
	"github.com/sluicehq/sluice/jobs"
	"github.com/sluicehq/sluice/worker"
)

// exitCannotRun is the exit code when Redis, the metrics address or the
// embedded Redis failed; bad arguments and config are cli.ExitBadInput.
const exitCannotRun = 1

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Stdin, os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// run runs the command line args and returns the exit code.
func run(ctx context.Context, args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	return cli.Execute(ctx, newRootCommand(), args, stdin, stdout, stderr, func(stderr io.Writer, err error) {
		var problems *config.Problems
		if !errors.As(err, &problems) {
			// Package worker's errors carry its name already.
			fmt.Fprintf(stderr, "worker: %s\n", strings.TrimPrefix(err.Error(), "worker: "))
			return
		}
		for _, p := range problems.Errs { // one line per problem, each naming its file and line (or variable) and key
			fmt.Fprintf(stderr, "worker: %v\n", p)
		}
	})
}

// flags are the worker command's flags.
type flags struct {
	configPath   string
	embedded     bool
	demo         int
	hashPassword bool
}

func newRootCommand() *cobra.Command {
	var f flags
	cmd := &cobra.Command{
		Use:   "worker [flags]",
		Short: "Run a sluice worker: the queues of the config, through their gates, until SIGINT or SIGTERM",
		Long: `Run a sluice worker until SIGINT or SIGTERM, then stop gracefully (running
tasks finish). It serves the queues of the config through asynq, puts every
task through its gates (drain rate, quotas, concurrency) and runs the built-in
task types (demo:noop, demo:sleep, http:request). Prometheus metrics, the web
UI (/ui/, read-only unless worker.ui.writes) and /healthz are on
worker.metrics_addr. A change to the config file's rates, quotas and limits
is in force within well under 2 s.

To run your own task types, use the Go package github.com/sluicehq/sluice/worker.

Exit codes: 0 after a graceful stop, 1 when it cannot run, 2 bad config or
arguments (one line per problem, naming its key).`,
		Example: `  worker --config config.yaml
  worker --embedded-redis --demo 100
  worker --hash-password < password.txt`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if f.hashPassword {
				return printHash(cmd)
			}
			return serve(cmd, f)
		},
	}
	cli.Setup(cmd)
	fl := cmd.Flags()
	fl.SortFlags = false
	fl.StringVar(&f.configPath, "config", "config.yaml", "the config `file` (SLUICE_* variables override it)")
	fl.BoolVar(&f.embedded, "embedded-redis", false, "serve an in-process, non-durable Redis on redis.addr (a try-out, not a store)")
	fl.IntVar(&f.demo, "demo", 0, "enqueue `N` demo:noop tasks into each queue and show their progress")
	fl.BoolVar(&f.hashPassword, "hash-password", false, "read a password from stdin, print its bcrypt hash for worker.ui.password_hash, and exit")
	_ = cmd.MarkFlagFilename("config", "yaml", "yml")
	return cmd
}

// serve runs the worker with the built-in task types until the command's
// context ends.
func serve(cmd *cobra.Command, f flags) error {
	log := slog.New(slog.NewTextHandler(cmd.ErrOrStderr(), &slog.HandlerOptions{Level: logLevel()}))
	redis.SetLogger(redisLog{log})
	w, err := worker.New(f.configPath, worker.WithLogger(log))
	if err != nil {
		return cli.BadInput(err)
	}
	file := w.Config()
	allow, err := jobs.ParseAllowList(file.Jobs.HTTP.Allow)
	if err != nil { // config.Load checked it
		return cli.BadInput(err)
	}
	jobs.Register(w, allow)

	ctx := cmd.Context()
	if f.embedded {
		closeRedis, err := startEmbeddedRedis(ctx, file.Redis.Addr, log)
		if err != nil {
			return cannotRun(fmt.Errorf("embedded redis: %w", err))
		}
		defer closeRedis()
	}
	if f.demo > 0 {
		// The demo's tasks wait in Redis until the worker below is serving.
		go runDemo(ctx, file.Redis.AsynqOpt(), file.Jobs, f.demo, cmd.OutOrStdout(), log)
	}
	if err := w.Run(ctx); err != nil {
		if errors.As(err, new(*config.Problems)) {
			return cli.BadInput(err) // a typo in a task type (jobs.CheckHandled)
		}
		return cannotRun(err)
	}
	return nil
}

// printHash prints the bcrypt hash of the first line of stdin, for
// worker.ui.password_hash.
func printHash(cmd *cobra.Command) error {
	input, err := io.ReadAll(io.LimitReader(cmd.InOrStdin(), 1<<10))
	if err != nil {
		return cli.BadInput(fmt.Errorf("--hash-password: %w", err))
	}
	password, _, _ := strings.Cut(string(input), "\n")
	hash, err := bcrypt.GenerateFromPassword([]byte(strings.TrimSuffix(password, "\r")), bcrypt.DefaultCost)
	if err != nil {
		return cli.BadInput(fmt.Errorf("--hash-password: %w", err))
	}
	fmt.Fprintln(cmd.OutOrStdout(), string(hash))
	return nil
}

// logLevel reads SLUICE_LOG_LEVEL (debug, info, warn, error; default info).
func logLevel() slog.Level {
	var level slog.Level
	if err := level.UnmarshalText([]byte(os.Getenv("SLUICE_LOG_LEVEL"))); err != nil {
		return slog.LevelInfo
	}
	return level
}

// redisLog takes go-redis's own log lines ("failed to dial after 5
// attempts") down to debug level: the worker and asynq report each failure
// that matters in their own words, and a refused login must be one line.
type redisLog struct{ log *slog.Logger }

func (l redisLog) Printf(ctx context.Context, format string, args ...any) {
	l.log.DebugContext(ctx, fmt.Sprintf(format, args...), "from", "go-redis")
}

// cannotRun marks err as a failure to run, not the user's input.
func cannotRun(err error) error { return &cli.ExitError{Code: exitCannotRun, Err: err} }
