package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/config"
	"github.com/sluicehq/sluice/jobs"
	"github.com/sluicehq/sluice/producer"
)

// enqueueTasks is how many tasks each enqueue measurement loads.
const enqueueTasks = 100_000

// runEnqueue measures `enqueue --file` (the real binary, built for the
// run), and the same work in process through package producer, against
// asynq.Client.Enqueue called once per task in a loop, on the same tasks
// and server, each round starting from an empty queue.
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
		viaFile     = "enqueue --file"
		viaProducer = "producer.CheckTasks + Loader.Load"
		viaLoop     = "asynq.Client.Enqueue loop"
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
		{viaProducer, func(ctx context.Context) (float64, error) {
			if err := fresh(); err != nil {
				return 0, err
			}
			start := time.Now()
			if err := loadInProcess(ctx, config, queue, path); err != nil {
				return 0, fmt.Errorf("%s: %w", viaProducer, err)
			}
			elapsed := time.Since(start)
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
	loop, command := rates[viaLoop], rates[viaFile]
	fmt.Fprintf(b.out, `
### enqueue: loading %s tasks

The same %s http:request tasks (payloads of about 50 bytes), loaded into an empty queue on the same redis-server: by the enqueue command, built for the run, from a JSON Lines file (`+"`enqueue --file`"+`: the process from start to exit, reading and checking every line included, then a bounded pool of goroutines sharing one asynq.Client); by the same work in this process through package producer (the config loaded, the file checked and loaded, as the command does, without starting a process); and by one asynq.Client calling Enqueue once per task in a loop. Median of %d rounds, rows interleaved.

| method | tasks | seconds | tasks/s | ratio to the loop | ratio to the binary |
|---|--:|--:|--:|--:|--:|
| %s | %s | %.2f | %s | %.2f | 1.00 |
| %s | %s | %.2f | %s | %.2f | %.2f |
| %s | %s | %.2f | %s | 1.00 | |

`, grouped(enqueueTasks), grouped(enqueueTasks), b.rounds,
		"`"+viaFile+"`", grouped(enqueueTasks), enqueueTasks/command, grouped(command), command/loop,
		"`"+viaProducer+"` (in process)", grouped(enqueueTasks), enqueueTasks/rates[viaProducer], grouped(rates[viaProducer]), rates[viaProducer]/loop, rates[viaProducer]/command,
		"`"+viaLoop+"`", grouped(enqueueTasks), enqueueTasks/loop, grouped(loop))
	return nil
}

// loadInProcess does what `enqueue --config configPath --queue queue
// --file path` does, in this process: it loads the config, checks every
// line of the file, and loads them through a producer.Loader on a client
// made as the command makes its own.
func loadInProcess(ctx context.Context, configPath, queue, path string) error {
	f, err := config.Load(configPath)
	if err != nil {
		return err
	}
	in, err := producer.OpenFile(path)
	if err != nil {
		return err
	}
	defer in.Close()
	d := producer.Defaults{Queue: queue, Payloads: f}
	now := time.Now()
	c, err := producer.CheckTasks(in, path, 0, d, now, func(q string) bool { _, ok := f.Jobs.Queues[q]; return ok })
	if err != nil {
		return err
	}
	if _, err := in.Seek(0, io.SeekStart); err != nil {
		return err
	}
	rdb := f.Redis.ClientWith(func(o *redis.UniversalOptions) {
		o.PoolSize, o.MaxRetries, o.DialerRetries = producer.LoadPool, -1, 1
	})
	defer rdb.Close()
	y := producer.NewTally()
	if err := producer.NewLoader(rdb).Load(ctx, producer.FileTasks(in, path, 0, d, now), nil, y.Add); err != nil {
		return err
	}
	if y.Landed() != c.Tasks {
		return y.FileFailure(path, "Redis", nil)
	}
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
