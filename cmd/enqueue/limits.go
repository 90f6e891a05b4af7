package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/user"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/spf13/cobra"

	"github.com/sluicehq/sluice/config"
	"github.com/sluicehq/sluice/internal/strictjson"
	"github.com/sluicehq/sluice/jobs"
)

func newLimitsCommand(a *app) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "limits list|set|reset|history|import",
		Short: "Change the fleet's limits live, with an audit trail",
		Long: `Change a gate's limit on every worker of the fleet at once, without editing
config.yaml: a queue's drain is drain:QUEUE (a fair queue's too), a quota
quota:NAME. An override is kept in Redis and takes precedence over the
file's limit until it is reset or lapses (--for); every worker has it in
force within a second, books waiting tasks again at the new rate, and a
worker started later has it from its first task. Each change is recorded
with who made it and why: limits history.`,
		Args: cobra.NoArgs,
	}
	cmd.AddCommand(newLimitsListCommand(a), newLimitsSetCommand(a), newLimitsResetCommand(a),
		newLimitsHistoryCommand(a), newLimitsImportCommand(a))
	return cmd
}

// limitsSession is what every limits subcommand starts with: the config
// file, checked, and a connection to its Redis.
type limitsSession struct {
	file config.File
	rdb  redis.UniversalClient
}

func (a *app) openLimits(ctx context.Context) (*limitsSession, error) {
	file, err := a.loadConfig()
	if err != nil {
		return nil, err
	}
	rdb := file.Redis.Client()
	if err := checkLogin(ctx, file.Redis, rdb); err != nil {
		rdb.Close()
		return nil, err
	}
	return &limitsSession{file: file, rdb: rdb}, nil
}

// changeFailed is the exit for err from a change: the user's to fix, or
// Redis's failure.
func changeFailed(err error, at config.Redis) error {
	var refused *jobs.LimitChangeError
	if errors.As(err, &refused) {
		if refused.Field == "gate" {
			return badInput(errors.New(refused.Problem))
		}
		return badInput(fmt.Errorf("--%s: %s", refused.Field, refused.Problem))
	}
	return redisFailed(fmt.Errorf("%s: %w", redisAt(at), err))
}

// whoFlag adds --by, defaulting to the OS user.
func whoFlag(cmd *cobra.Command, by *string) {
	name := os.Getenv("USER")
	if u, err := user.Current(); err == nil {
		name = u.Username
	}
	cmd.Flags().StringVar(by, "by", name, "who makes the change, for the history (default: the OS user)")
}

func parseGate(arg string) (jobs.GateName, error) {
	gate, err := jobs.ParseGateName(arg)
	if err != nil {
		return gate, badInput(err)
	}
	return gate, nil
}

func newLimitsSetCommand(a *app) *cobra.Command {
	var ch jobs.LimitChange
	cmd := &cobra.Command{
		Use:   "set GATE [--key VALUE] [--limit N] [--period D] [--burst N] [--algorithm A] [--for D] --reason TEXT",
		Short: "Override a gate's limit (or one key value's) on every worker",
		Long: `Override a gate's limit, or one key value's of a keyed gate (--key), on every
worker. The fields given replace the file's, the others are kept. --for
makes the override lapse by itself. A bad value exits 2 naming the flag, and
nothing changes.`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			gate, err := parseGate(args[0])
			if err != nil {
				return err
			}
			ch.Gate = gate
			s, err := a.openLimits(cmd.Context())
			if err != nil {
				return err
			}
			defer s.rdb.Close()
			set, err := jobs.SetLimit(cmd.Context(), s.rdb, s.file.Jobs, ch)
			if err != nil {
				return changeFailed(err, s.file.Redis)
			}
			fmt.Fprintf(cmd.OutOrStdout(), "%s%s: %s, in force on every worker within a second%s\n",
				gate, keySuffix(set.Key), overrideText(set), lapseText(set))
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&ch.Key, "key", "", "override one key value of a keyed gate")
	f.IntVar(&ch.Limit, "limit", 0, "events per period")
	f.DurationVar(&ch.Period, "period", 0, "the period (1s, 1m, 1h)")
	f.IntVar(&ch.Burst, "burst", 0, "a bucket's size")
	f.StringVar(&ch.Algorithm, "algorithm", "", "fixed_window, sliding_log, sliding_counter, token_bucket or leaky_bucket")
	f.DurationVar(&ch.For, "for", 0, "lapse this long after it is set (default: until reset)")
	f.StringVar(&ch.Reason, "reason", "", "why, for the history (required)")
	whoFlag(cmd, &ch.By)
	return cmd
}

func newLimitsResetCommand(a *app) *cobra.Command {
	var key, by, reason string
	cmd := &cobra.Command{
		Use:   "reset GATE [--key VALUE] --reason TEXT",
		Short: "Take a gate's override away: the file's limit is in force again",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			gate, err := parseGate(args[0])
			if err != nil {
				return err
			}
			s, err := a.openLimits(cmd.Context())
			if err != nil {
				return err
			}
			defer s.rdb.Close()
			had, err := jobs.ResetLimit(cmd.Context(), s.rdb, s.file.Jobs, gate, key, by, reason)
			if err != nil {
				return changeFailed(err, s.file.Redis)
			}
			if !had {
				fmt.Fprintf(cmd.OutOrStdout(), "%s%s had no override: nothing changed\n", gate, keySuffix(key))
				return nil
			}
			fmt.Fprintf(cmd.OutOrStdout(), "%s%s: the file's limit, in force on every worker within a second\n", gate, keySuffix(key))
			return nil
		},
	}
	cmd.Flags().StringVar(&key, "key", "", "reset one key value's override of a keyed gate")
	cmd.Flags().StringVar(&reason, "reason", "", "why, for the history (required)")
	whoFlag(cmd, &by)
	return cmd
}

func newLimitsListCommand(a *app) *cobra.Command {
	var asJSON, keys bool
	cmd := &cobra.Command{
		Use:   "list [--keys] [--json]",
		Short: "Every gate: its limit in the file, in force, and who set it live, when and why",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			s, err := a.openLimits(cmd.Context())
			if err != nil {
				return err
			}
			defer s.rdb.Close()
			gates, err := jobs.ListLimits(cmd.Context(), s.rdb, s.file.Jobs, keys)
			if err != nil {
				return redisFailed(fmt.Errorf("%s: %w", redisAt(s.file.Redis), err))
			}
			if asJSON {
				return json.NewEncoder(cmd.OutOrStdout()).Encode(map[string]any{"gates": gates})
			}
			return printLimits(cmd.OutOrStdout(), gates)
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print one JSON document")
	cmd.Flags().BoolVar(&keys, "keys", false, "list every key value's override too")
	return cmd
}

func printLimits(w io.Writer, gates []jobs.GateLimits) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "GATE\tFILE\tIN FORCE\tSET BY\tAT\tLAPSES\tREASON")
	for _, g := range gates {
		inForce, by, at, lapses, reason := "the file's", "-", "-", "-", "-"
		if o := g.Override; o != nil {
			inForce, by, at, reason = g.InForce.String(), o.By, o.At.Local().Format(time.DateTime), o.Reason
			lapses = lapseAt(*o)
		}
		if g.KeyOverrides > 0 {
			inForce += fmt.Sprintf(" (+%d key overrides)", g.KeyOverrides)
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\n", g.Gate, g.File, inForce, by, at, lapses, reason)
	}
	var keyed []jobs.RuntimeLimit
	for _, g := range gates {
		keyed = append(keyed, g.Keys...)
	}
	if len(keyed) > 0 {
		fmt.Fprintln(tw)
		fmt.Fprintln(tw, "GATE\tKEY\tOVERRIDE\tSET BY\tAT\tLAPSES\tREASON")
		for _, r := range keyed {
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\n", r.Gate, r.Key, overrideText(r), r.By, r.At.Local().Format(time.DateTime), lapseAt(r), r.Reason)
		}
	}
	return tw.Flush()
}

// overrideText shows the fields an override sets: "limit 25, burst 5".
func overrideText(r jobs.RuntimeLimit) string {
	var parts []string
	if r.Algorithm != "" {
		parts = append(parts, r.Algorithm)
	}
	if r.Limit != 0 {
		parts = append(parts, fmt.Sprintf("limit %d", r.Limit))
	}
	if r.Period != 0 {
		parts = append(parts, "period "+shortDuration(r.Period))
	}
	if r.Burst != 0 {
		parts = append(parts, fmt.Sprintf("burst %d", r.Burst))
	}
	return strings.Join(parts, ", ")
}

func lapseAt(r jobs.RuntimeLimit) string {
	if r.Until.IsZero() {
		return "-"
	}
	return r.Until.Local().Format(time.DateTime)
}

func lapseText(r jobs.RuntimeLimit) string {
	if r.Until.IsZero() {
		return " (until reset)"
	}
	return ", lapsing at " + r.Until.Local().Format(time.DateTime)
}

func keySuffix(key string) string {
	if key == "" {
		return ""
	}
	return fmt.Sprintf(" key %q", key)
}

func newLimitsHistoryCommand(a *app) *cobra.Command {
	var n int
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "history [GATE] [--limit N] [--json]",
		Short: "The changes made live, newest first, with who made them and why",
		Args:  cobra.MaximumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			var gate jobs.GateName
			if len(args) == 1 {
				var err error
				if gate, err = parseGate(args[0]); err != nil {
					return err
				}
			}
			if n < 1 || n > maxHistoryShown {
				return badInput(fmt.Errorf("--limit must be from 1 to %d, got %d", maxHistoryShown, n))
			}
			s, err := a.openLimits(cmd.Context())
			if err != nil {
				return err
			}
			defer s.rdb.Close()
			events, err := jobs.LimitHistory(cmd.Context(), s.rdb, gate, n)
			if err != nil {
				return redisFailed(fmt.Errorf("%s: %w", redisAt(s.file.Redis), err))
			}
			out := cmd.OutOrStdout()
			if asJSON {
				return json.NewEncoder(out).Encode(map[string]any{"events": events})
			}
			tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
			fmt.Fprintln(tw, "AT\tBY\tACTION\tGATE\tCHANGE\tREASON")
			for _, e := range events {
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\n", e.At.Local().Format(time.DateTime), e.By, e.Action, gateText(e), changeText(e), e.Reason)
			}
			return tw.Flush()
		},
	}
	cmd.Flags().IntVar(&n, "limit", 20, "how many changes to show")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print one JSON document")
	return cmd
}

// maxHistoryShown is the most history --limit shows: all that is kept.
const maxHistoryShown = 10_000

func gateText(e jobs.LimitEvent) string {
	if e.Gate == (jobs.GateName{}) {
		return "-"
	}
	return e.Gate.String() + keySuffix(e.Key)
}

func changeText(e jobs.LimitEvent) string {
	switch {
	case e.Set != nil:
		return overrideText(*e.Set) + lapseText(*e.Set)
	case e.Action == "import":
		return fmt.Sprintf("%d key overrides", e.Count)
	case e.Action == "lapse":
		return "the override lapsed"
	}
	return "the file's limit"
}

// importLine is one line of limits import's file.
type importLine struct {
	Gate      string `json:"gate"`
	Key       string `json:"key"`
	Algorithm string `json:"algorithm"`
	Limit     int    `json:"limit"`
	Period    string `json:"period"`
	Burst     int    `json:"burst"`
	For       string `json:"for"`
}

// Bounds on limits import's file.
const (
	maxImportFile = 64 << 20 // bytes
	maxImportLine = 64 << 10 // bytes
)

func newLimitsImportCommand(a *app) *cobra.Command {
	var by, reason string
	cmd := &cobra.Command{
		Use:   "import FILE --reason TEXT",
		Short: "Set many key overrides at once from a JSON Lines file, all or nothing",
		Long: `Set key overrides from FILE ("-": stdin), one JSON object a line:
  {"gate": "quota:crm", "key": "customer-42", "limit": 20, "period": "1s", "burst": 20, "for": "720h"}
(gate and key required; the others as for limits set). Every line is checked
before anything is written: a bad line exits 2 naming it, and nothing
changes. Then all are put in force at once, recorded as one change.`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			start := time.Now()
			chs, err := readImport(cmd, args[0])
			if err != nil {
				return err
			}
			s, err := a.openLimits(cmd.Context())
			if err != nil {
				return err
			}
			defer s.rdb.Close()
			progress := cmd.ErrOrStderr()
			fmt.Fprintf(progress, "limits import: read %d overrides in %v; checking them against the config and writing them in one transaction\n", len(chs), time.Since(start).Round(time.Millisecond))
			start = time.Now()
			err = jobs.ImportLimits(cmd.Context(), s.rdb, s.file.Jobs, chs, by, reason)
			var refused *jobs.LimitChangeError
			if errors.As(err, &refused) {
				return badInput(fmt.Errorf("%s: line %w", args[0], err))
			}
			if err != nil {
				return changeFailed(err, s.file.Redis)
			}
			fmt.Fprintf(progress, "limits import: checked and written in %v\n", time.Since(start).Round(time.Millisecond))
			fmt.Fprintf(cmd.OutOrStdout(), "%d key overrides in force on every worker within a few seconds\n", len(chs))
			return nil
		},
	}
	cmd.Flags().StringVar(&reason, "reason", "", "why, for the history (required)")
	whoFlag(cmd, &by)
	return cmd
}

// readImport reads and parses limits import's file, bounded.
func readImport(cmd *cobra.Command, path string) ([]jobs.LimitChange, error) {
	var r io.Reader = cmd.InOrStdin()
	if path != "-" {
		f, err := os.Open(path)
		if err != nil {
			return nil, badInput(err)
		}
		defer f.Close()
		r = f
	}
	sc := bufio.NewScanner(io.LimitReader(r, maxImportFile+1))
	sc.Buffer(make([]byte, 0, 4096), maxImportLine)
	var chs []jobs.LimitChange
	read := 0
	for n := 1; sc.Scan(); n++ {
		read += len(sc.Bytes()) + 1
		if read > maxImportFile {
			return nil, badInput(fmt.Errorf("%s: more than %d MiB; split it", path, maxImportFile>>20))
		}
		if strings.TrimSpace(sc.Text()) == "" {
			continue
		}
		ch, err := parseImportLine(sc.Bytes())
		if err != nil {
			return nil, badInput(fmt.Errorf("%s: line %d: %w", path, n, err))
		}
		chs = append(chs, ch)
	}
	if err := sc.Err(); err != nil {
		if errors.Is(err, bufio.ErrTooLong) {
			err = fmt.Errorf("a line is longer than %d KiB", maxImportLine>>10)
		}
		return nil, badInput(fmt.Errorf("%s: %w", path, err))
	}
	if len(chs) == 0 {
		return nil, badInput(fmt.Errorf("%s: no override in it", path))
	}
	return chs, nil
}

func parseImportLine(b []byte) (jobs.LimitChange, error) {
	var line importLine
	if err := strictjson.Decode(b, &line); err != nil {
		return jobs.LimitChange{}, err
	}
	if line.Key == "" {
		return jobs.LimitChange{}, errors.New(`"key": required (import sets key values' overrides; use limits set for a whole gate)`)
	}
	gate, err := jobs.ParseGateName(line.Gate)
	if err != nil {
		return jobs.LimitChange{}, fmt.Errorf(`"gate": %w`, err)
	}
	ch := jobs.LimitChange{Gate: gate, Key: line.Key, Algorithm: line.Algorithm, Limit: line.Limit, Burst: line.Burst}
	for _, d := range []struct {
		name string
		text string
		to   *time.Duration
	}{{"period", line.Period, &ch.Period}, {"for", line.For, &ch.For}} {
		if d.text == "" {
			continue
		}
		if *d.to, err = time.ParseDuration(d.text); err != nil {
			return jobs.LimitChange{}, fmt.Errorf("%q: %w", d.name, err)
		}
	}
	return ch, nil
}
