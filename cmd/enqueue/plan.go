package main

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"text/tabwriter"
	"time"

	"github.com/hibiken/asynq"
	"github.com/spf13/cobra"

	"github.com/sluicehq/sluice/config"
	"github.com/sluicehq/sluice/jobs"
	"github.com/sluicehq/sluice/producer"
)

func newPlanCommand(a *app) *cobra.Command {
	var path, queue string
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "plan [--file F] [--queue Q] [--json]",
		Short: "Predict when each queue will be empty, before enqueueing",
		Long: `Predict, from the config, the backlog now in Redis and the tasks of --file
(JSON Lines, as "enqueue --file" reads them; "-" reads stdin), when each
queue will be empty (its last task starts) and how busy each quota will be.
Every task books its turn on its gates as a worker would, the queues taken in
turn by their priorities, on in-process copies of the gates run on a clock
of the plan's own: it answers at once, and it changes nothing in Redis.
Tasks waiting in Redis for a booked turn keep it. Not modelled: concurrency
limits and how long handlers take, and upstreams that say "not now".
--queue is the queue of lines that name none (default "default"). A table by
default; --json prints one JSON document.`,
		Args: func(cmd *cobra.Command, args []string) error {
			if len(args) > 0 {
				return badInput(fmt.Errorf("plan takes no arguments, got %q (the tasks come from --file)", args))
			}
			return checkQueueFlag(queue)
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			file, rdb, err := a.connect(cmd)
			if err != nil {
				return err
			}
			defer rdb.Close()
			ctx := cmd.Context()
			now, err := rdb.Time(ctx).Result()
			if err != nil {
				return redisFailed(fmt.Errorf("plan: reading the time of %s: %w", redisAt(file.Redis), err))
			}
			var fromFile []jobs.PlanTask
			if path != "" {
				if fromFile, err = planFileTasks(cmd, file, path, queue, now); err != nil {
					return err
				}
			}
			cfg, err := jobs.InForce(ctx, rdb, file.Jobs, now)
			if err != nil {
				return redisFailed(fmt.Errorf("plan: the limits set live in %s: %w", redisAt(file.Redis), err))
			}
			tasks, err := jobs.BacklogTasks(ctx, rdb, rdb, cfg, jobs.MaxPlanTasks-len(fromFile))
			if err != nil {
				return redisFailed(fmt.Errorf("plan: the backlog in %s: %w", redisAt(file.Redis), err))
			}
			plan, err := jobs.PlanOf(cfg, now, append(tasks, fromFile...))
			if err != nil {
				return badInput(err)
			}
			if asJSON {
				return json.NewEncoder(cmd.OutOrStdout()).Encode(plan)
			}
			return printPlan(cmd.OutOrStdout(), plan, cfg.Defaults())
		},
	}
	cmd.Flags().StringVar(&path, "file", "", "also count the tasks of this JSON Lines `FILE`, to be enqueued (\"-\": stdin)")
	cmd.Flags().StringVar(&queue, "queue", "default", "the `queue` of --file's lines that name none")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print one JSON document")
	return cmd
}

// planFileTasks reads and checks every task of path, as enqueue --file
// does (a bad line is bad input, and nothing is planned), for a plan at
// now.
func planFileTasks(cmd *cobra.Command, file config.File, path, queue string, now time.Time) ([]jobs.PlanTask, error) {
	var in *os.File
	var err error
	name := path
	if path == "-" {
		in, err = producer.Spool(cmd.InOrStdin())
		name = "stdin"
	} else {
		in, err = producer.OpenFile(path)
	}
	if err != nil {
		return nil, badInput(err)
	}
	defer in.Close()
	d := producer.Defaults{Queue: queue, Payloads: file}
	known := func(q string) bool { _, ok := file.Jobs.Queues[q]; return ok }
	var tasks []jobs.PlanTask
	c, err := producer.ReadTasks(in, name, 0, d, now, known, func(t producer.Task) {
		if len(tasks) < jobs.MaxPlanTasks {
			tasks = append(tasks, planTask(t, now))
		}
	})
	if err != nil {
		return nil, badInput(err)
	}
	if c.Tasks > jobs.MaxPlanTasks {
		return nil, badInput(fmt.Errorf("%s holds %d tasks; a plan takes at most %d", name, c.Tasks, jobs.MaxPlanTasks))
	}
	warnUnconfigured(cmd.ErrOrStderr(), file, c.Queues, c.More)
	return tasks, nil
}

// planTask is t, to be enqueued at now, as a plan counts it.
func planTask(t producer.Task, now time.Time) jobs.PlanTask {
	return jobs.PlanTask{Queue: t.Queue, Type: t.Asynq.Type(), ID: t.TaskID, Payload: t.Asynq.Payload(),
		Headers: t.Asynq.Headers(), Ready: readyAt(t.Opts, now)}
}

// readyAt is when a task enqueued at now with opts may run: at once, or
// when --process-at or --process-in say.
func readyAt(opts []asynq.Option, now time.Time) time.Time {
	for _, o := range opts {
		switch o.Type() {
		case asynq.ProcessAtOpt:
			if at, ok := o.Value().(time.Time); ok {
				return at
			}
		case asynq.ProcessInOpt:
			if d, ok := o.Value().(time.Duration); ok {
				return now.Add(d)
			}
		}
	}
	return time.Time{}
}

func printPlan(w io.Writer, p jobs.Plan, cfg jobs.Config) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	clock := func(t time.Time) string { return t.Local().Format("15:04:05.000") }
	in := func(t time.Time) string { return t.Sub(p.Now).Round(time.Millisecond).String() }
	busy := func(b *float64) string {
		if b == nil {
			return "-"
		}
		return fmt.Sprintf("%.0f%%", 100**b)
	}
	fmt.Fprintf(tw, "PLAN at %s (Redis's clock): %d tasks; every queue empty at %s (in %s)\n",
		p.Now.Local().Format(time.DateTime), p.Tasks, clock(p.Empty), in(p.Empty))
	if len(p.Queues) > 0 {
		fmt.Fprintln(tw, "QUEUE\tTASKS\tIN REDIS\tFROM FILE\tEMPTY AT\tIN\tDRAIN\tDRAIN BUSY")
		for _, q := range p.Queues {
			drain := "none"
			switch qc, ok := cfg.Queues[q.Name]; {
			case !ok:
				drain = "not in config: no worker serves it"
			case qc.Drain != nil:
				drain = newGateStatus("", *qc.Drain, nil, "").describe()
			}
			fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%s\t%s\t%s\t%s\n", q.Name, q.Tasks, q.InRedis, q.FromFile, clock(q.Empty), in(q.Empty), drain, busy(q.DrainBusy))
		}
	}
	if len(p.Quotas) > 0 {
		fmt.Fprintln(tw)
		fmt.Fprintln(tw, "QUOTA\tLIMIT\tEVENTS\tBUSY UNTIL\tIN\tBUSY")
		for _, q := range p.Quotas {
			until, after := "-", "-"
			if !q.Until.IsZero() {
				until, after = clock(q.Until), in(q.Until)
			}
			limit := newGateStatus(q.Name, cfg.Quotas[q.Name], nil, "").describe()
			fmt.Fprintf(tw, "%s\t%s\t%d\t%s\t%s\t%s\n", q.Name, limit, q.Events, until, after, busy(q.Busy))
		}
	}
	return tw.Flush()
}
