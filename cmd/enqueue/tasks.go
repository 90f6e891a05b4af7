package main

import (
	"context"
	"fmt"
	"io"
	"text/tabwriter"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/spf13/cobra"

	"github.com/sluicehq/sluice/jobs"
)

// tasksSnapshot is what status --queue Q --tasks shows.
type tasksSnapshot struct {
	Time  time.Time `json:"time"`
	Queue string    `json:"queue"`
	Tasks []etaJSON `json:"tasks"`
}

// taskStatus prints queue's waiting tasks with their predicted starts, the
// top soonest, once or every second with watch until ctx is done.
func (a *app) taskStatus(cmd *cobra.Command, queue string, top int, watch, asJSON bool) error {
	return a.watch(cmd, watch, asJSON, func(ctx context.Context, rdb redis.UniversalClient, cfg jobs.Config) (any, error) {
		s := tasksSnapshot{Time: time.Now().UTC().Truncate(time.Millisecond), Queue: queue, Tasks: []etaJSON{}}
		cfg, err := jobs.InForce(ctx, rdb, cfg, s.Time)
		if err != nil {
			return s, err
		}
		etas, err := jobs.QueueETAs(ctx, rdb, rdb, cfg, queue, top)
		for _, e := range etas {
			s.Tasks = append(s.Tasks, etaDoc(e))
		}
		return s, err
	}, func(w io.Writer, v any) error { return printTasks(w, v.(tasksSnapshot)) })
}

func printTasks(w io.Writer, s tasksSnapshot) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	if len(s.Tasks) == 0 {
		fmt.Fprintf(tw, "TASKS OF %s at %s: none waits to start\n", s.Queue, s.Time.Local().Format(time.DateTime))
		return tw.Flush()
	}
	fmt.Fprintf(tw, "TASKS OF %s at %s (the soonest %d)\n", s.Queue, s.Time.Local().Format(time.DateTime), len(s.Tasks))
	fmt.Fprintln(tw, "TASK\tTYPE\tSTATE\tPOSITION\tSTARTS AT\tIN")
	for _, e := range s.Tasks {
		id, position, at, in := e.ID, "-", "-", "-"
		if e.WaitsAs != "" {
			id += " (as " + e.WaitsAs + ")"
		}
		if e.Position > 0 {
			position = fmt.Sprint(e.Position)
		}
		if !e.At.IsZero() {
			at, in = e.At.Local().Format("15:04:05.000"), e.Wait().Round(time.Millisecond).String()
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\n", id, e.Type, e.State, position, at, in)
	}
	return tw.Flush()
}
