package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/spf13/cobra"

	"github.com/sluicehq/sluice/jobs"
	"github.com/sluicehq/sluice/producer"
)

func newETACommand(a *app) *cobra.Command {
	var queue string
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "eta TASK_ID [--queue Q] [--json]",
		Short: "Tell when a task is predicted to start",
		Long: `Tell when one task is predicted to start, and why:
  booked        it waits in Redis for the turn its gates booked it: it starts then
  asks_again    not booked yet: it asks its gates again at the time shown
  pending       in its queue at about position P (1 is taken next): predicted
                from its gates' rates and levels and the backlog ahead of it
  running       a worker has it (holding for its turn, if a time is shown)
  scheduled, retry, archived, completed: as asynq holds it
A task with no retry left waits as a copy (<id>~<hop>): the copy is found and
named. Without --queue every queue is searched. Times are Redis's clock, shown
in local time. An id no queue holds exits 2.`,
		Args: func(cmd *cobra.Command, args []string) error {
			if len(args) != 1 {
				return badInput(fmt.Errorf("eta takes one TASK_ID, got %d arguments", len(args)))
			}
			if id := args[0]; id == "" || len(id) > producer.MaxTaskID {
				return badInput(fmt.Errorf("a TASK_ID is 1 to %d bytes, got %d", producer.MaxTaskID, len(id)))
			}
			if cmd.Flags().Changed("queue") {
				return checkQueueFlag(queue)
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			file, rdb, err := a.connect(cmd)
			if err != nil {
				return err
			}
			defer rdb.Close()
			cfg, err := jobs.InForce(cmd.Context(), rdb, file.Jobs, time.Now())
			if err != nil {
				return redisFailed(fmt.Errorf("eta from %s: %w", redisAt(file.Redis), err))
			}
			e, err := jobs.ETA(cmd.Context(), rdb, rdb, cfg, queue, args[0])
			if errors.As(err, new(*jobs.TaskNotFoundError)) || errors.As(err, new(*jobs.AmbiguousTaskError)) {
				return badInput(err)
			}
			if err != nil {
				return redisFailed(fmt.Errorf("eta from %s: %w", redisAt(file.Redis), err))
			}
			if asJSON {
				return json.NewEncoder(cmd.OutOrStdout()).Encode(etaDoc(e))
			}
			printETA(cmd.OutOrStdout(), e)
			return nil
		},
	}
	cmd.Flags().StringVar(&queue, "queue", "", "the task's `queue` (default: search every queue)")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}

// etaJSON is a task's ETA as --json prints it.
type etaJSON struct {
	jobs.TaskETA
	WaitSeconds float64 `json:"wait_seconds"` // from now until at
}

func etaDoc(e jobs.TaskETA) etaJSON { return etaJSON{e, e.Wait().Seconds()} }

// printETA prints e in one line.
func printETA(w io.Writer, e jobs.TaskETA) {
	name := fmt.Sprintf("task %s in %s (%s)", e.ID, e.Queue, e.Type)
	if e.WaitsAs != "" {
		name += fmt.Sprintf(", waiting as its copy %s,", e.WaitsAs)
	}
	fmt.Fprintf(w, "%s: %s\n", name, describeETA(e))
}

// describeETA says e's state and start in words.
func describeETA(e jobs.TaskETA) string {
	at := func() string {
		return fmt.Sprintf("%s (in %s)", e.At.Local().Format("15:04:05.000"), e.Wait().Round(time.Millisecond))
	}
	switch e.State {
	case jobs.TaskBooked:
		return "booked: its turn is at " + at()
	case jobs.TaskAsksAgain:
		return "not booked yet: asks again at " + at()
	case jobs.TaskPending:
		s := fmt.Sprintf("pending: about position %d, predicted start %s from the drain rate and the backlog ahead", e.Position, at())
		if e.Paused {
			s += " (the queue is paused: counted from when it resumes)"
		}
		return s
	case jobs.TaskRunning:
		if !e.At.IsZero() {
			return "in a worker, holding for its turn at " + at()
		}
		return "running"
	case jobs.TaskScheduled:
		return "scheduled by its producer for " + at()
	case jobs.TaskRetry:
		return "retried after a failure at " + at()
	case jobs.TaskArchived:
		return "archived: it will not run unless run again by hand"
	}
	return string(e.State)
}
