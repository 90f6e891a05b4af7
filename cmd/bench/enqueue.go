package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"time"

	"github.com/hibiken/asynq"

	"github.com/sluicehq/sluice/jobs"
)

// enqueueTasks is how many tasks each enqueue measurement loads.
const enqueueTasks = 100_000

// runEnqueue measures `enqueue --file` (the real binary, built for the
// run) against asynq.Client.Enqueue called once per task in a loop, on the
// same tasks and server, each round starting from an empty queue.
func runEnqueue(ctx context.Context, b *bench) error {
	dir, err := os.MkdirTemp("", "sluice-bench-enqueue-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	b.progress("building cmd/enqueue into %s", dir)
	binary := filepath.Join(dir, "enqueue")
	build := exec.CommandContext(ctx, "go", "build", "-o", binary, "github.com/sluicehq/sluice/cmd/enqueue")
	if out, err := build.CombinedOutput(); err != nil {
		return fmt.Errorf("go build cmd/enqueue: %w\n%s", err, out)
	}
	queue := b.runID + "-enqueue"
	config := filepath.Join(dir, "config.yaml")
	if err := os.WriteFile(config, fmt.Appendf(nil, "redis: {addr: %q}\nqueues:\n  %s: {}\n", b.addr, queue), 0o644); err != nil {
		return err
	}
	tasks, path, err := writeEnqueueFile(dir)
	if err != nil {
		return err
	}

	opt := asynq.RedisClientOpt{Addr: b.addr}
	inspector := asynq.NewInspector(opt)
	defer inspector.Close()
	// fresh empties the queue before a round; check says the round's tasks
	// are all there after it.
	fresh := func() error {
		if err := inspector.DeleteQueue(queue, true); err != nil && !errors.Is(err, asynq.ErrQueueNotFound) {
			return fmt.Errorf("emptying queue %s: %w", queue, err)
		}
		return nil
	}
	defer fresh()
	check := func() error {
		info, err := inspector.GetQueueInfo(queue)
		if err != nil {
			return err
		}
		if info.Pending != enqueueTasks {
			return fmt.Errorf("%d tasks pending after the round, want %d", info.Pending, enqueueTasks)
		}
		return nil
	}
	const (
		viaFile = "enqueue --file"
		viaLoop = "asynq.Client.Enqueue loop"
	)
	rates, err := inRounds(ctx, b, []measurement{
		{viaFile, func(ctx context.Context) (float64, error) {
			if err := fresh(); err != nil {
				return 0, err
			}
			cmd := exec.CommandContext(ctx, binary, "--config", config, "--queue", queue, "--file", path)
			start := time.Now()
			out, err := cmd.CombinedOutput()
			elapsed := time.Since(start)
			if err != nil {
				return 0, fmt.Errorf("%s: %w\n%s", viaFile, err, out)
			}
			return enqueueTasks / elapsed.Seconds(), check()
		}},
		{viaLoop, func(ctx context.Context) (float64, error) {
			if err := fresh(); err != nil {
				return 0, err
			}
			client := asynq.NewClient(opt)
			defer client.Close()
			start := time.Now()
			for _, t := range tasks {
				if _, err := client.EnqueueContext(ctx, t, asynq.Queue(queue)); err != nil {
					return 0, err
				}
			}
			elapsed := time.Since(start)
			return enqueueTasks / elapsed.Seconds(), check()
		}},
	})
	if err != nil {
		return err
	}
	loop := rates[viaLoop]
	fmt.Fprintf(b.out, `
### enqueue: loading %s tasks

The same %s http:request tasks (payloads of about 50 bytes), loaded into an empty queue on the same redis-server: by the enqueue command, built for the run, from a JSON Lines file (`+"`enqueue --file`"+`: the process from start to exit, reading and checking every line included, then a bounded pool of goroutines sharing one asynq.Client), and by one asynq.Client calling Enqueue once per task in a loop. Median of %d rounds, rows interleaved.

| method | tasks | seconds | tasks/s | ratio |
|---|--:|--:|--:|--:|
| %s | %s | %.2f | %s | %.2f |
| %s | %s | %.2f | %s | 1.00 |

`, grouped(enqueueTasks), grouped(enqueueTasks), b.rounds,
		"`"+viaFile+"`", grouped(enqueueTasks), enqueueTasks/rates[viaFile], grouped(rates[viaFile]), rates[viaFile]/loop,
		"`"+viaLoop+"`", grouped(enqueueTasks), enqueueTasks/loop, grouped(loop))
	return nil
}

// writeEnqueueFile writes the JSON Lines file of the tasks into dir and
// returns the same tasks for asynq.Client, and the file's path.
func writeEnqueueFile(dir string) ([]*asynq.Task, string, error) {
	path := filepath.Join(dir, "tasks.jsonl")
	f, err := os.Create(path)
	if err != nil {
		return nil, "", err
	}
	defer f.Close()
	w := bufio.NewWriter(f)
	tasks := make([]*asynq.Task, enqueueTasks)
	for i := range tasks {
		payload := fmt.Appendf(nil, `{"url":"http://127.0.0.1:8000/items/%d"}`, i)
		tasks[i] = asynq.NewTask(jobs.TypeHTTPRequest, payload)
		fmt.Fprintf(w, `{"type":%q,"payload":%s}`+"\n", jobs.TypeHTTPRequest, payload)
	}
	if err := w.Flush(); err != nil {
		return nil, "", err
	}
	return tasks, path, f.Close()
}
