package main

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/sluicehq/sluice/config"
	"github.com/sluicehq/sluice/jobs"
	"github.com/sluicehq/sluice/producer"
)

// planTasks is how many tasks each plan measurement plans: the issue asks
// for an answer in under a second for this many.
const planTasks = enqueueTasks

// runPlan measures `enqueue plan --file` (the real binary, built for the
// run) on 100,000 http:request tasks, for a queue behind a drain and a
// quota, with an empty backlog in Redis; and, in this process, its two
// parts: reading and checking the file (package producer, as the command
// does) and the plan itself (jobs.PlanOf), in rounds, rows interleaved.
func runPlan(ctx context.Context, b *bench) error {
	dir, err := os.MkdirTemp("", "sluice-bench-plan-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	b.progress("building cmd/enqueue into %s", dir)
	binary := filepath.Join(dir, "enqueue")
	if out, err := exec.CommandContext(ctx, "go", "build", "-o", binary, "github.com/sluicehq/sluice/cmd/enqueue").CombinedOutput(); err != nil {
		return fmt.Errorf("go build cmd/enqueue: %w\n%s", err, out)
	}
	queue, quota := b.runID+"-plan", b.runID+"-api"
	configPath := filepath.Join(dir, "config.yaml")
	yaml := fmt.Sprintf(`redis: {addr: %q}
queues:
  %s: {drain: {algorithm: leaky_bucket, limit: 1000, period: 1s, burst: 1}}
quotas:
  %s: {algorithm: token_bucket, limit: 800, period: 1s, burst: 100}
tasks:
  http:request: {quotas: [%s]}
`, b.addr, queue, quota, quota)
	if err := os.WriteFile(configPath, []byte(yaml), 0o644); err != nil {
		return err
	}
	_, path, err := writeEnqueueFile(dir)
	if err != nil {
		return err
	}
	file, err := config.Load(configPath)
	if err != nil {
		return err
	}
	tasks, err := readPlanFile(file, queue, path)
	if err != nil {
		return err
	}
	var planned jobs.Plan
	// cpu collects each step's CPU seconds (user + system), round by
	// round: on a shared machine they say more than the wall clock.
	cpu := map[string][]float64{}
	selfCPU := func() float64 {
		var ru syscall.Rusage
		_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
		return time.Duration(ru.Utime.Nano() + ru.Stime.Nano()).Seconds()
	}
	const (
		viaBinary = "enqueue plan --file"
		viaRead   = "read and check the file"
		viaPlan   = "jobs.PlanOf"
	)
	// Each measurement's figure is tasks per second; the table shows
	// seconds for planTasks.
	rates, err := inRounds(ctx, b, []measurement{
		{viaBinary, func(ctx context.Context) (float64, error) {
			start := time.Now()
			cmd := exec.CommandContext(ctx, binary, "--config", configPath, "plan", "--queue", queue, "--file", path, "--json")
			out, err := cmd.CombinedOutput()
			if err != nil {
				return 0, fmt.Errorf("%s: %w\n%s", viaBinary, err, out)
			}
			elapsed := time.Since(start)
			cpu[viaBinary] = append(cpu[viaBinary], (cmd.ProcessState.UserTime() + cmd.ProcessState.SystemTime()).Seconds())
			return planTasks / elapsed.Seconds(), nil
		}},
		{viaRead, func(context.Context) (float64, error) {
			start, used := time.Now(), selfCPU()
			if _, err := readPlanFile(file, queue, path); err != nil {
				return 0, err
			}
			elapsed := time.Since(start)
			cpu[viaRead] = append(cpu[viaRead], selfCPU()-used)
			return planTasks / elapsed.Seconds(), nil
		}},
		{viaPlan, func(context.Context) (float64, error) {
			start, used := time.Now(), selfCPU()
			var err error
			if planned, err = jobs.PlanOf(file.Jobs, start, tasks); err != nil {
				return 0, err
			}
			elapsed := time.Since(start)
			cpu[viaPlan] = append(cpu[viaPlan], selfCPU()-used)
			return planTasks / elapsed.Seconds(), nil
		}},
	})
	if err != nil {
		return err
	}
	seconds := func(name string) float64 { return planTasks / rates[name] }
	load, _ := os.ReadFile("/proc/loadavg")
	fmt.Fprintf(b.out, `
### plan: %s tasks before they are enqueued

`+"`enqueue plan --file`"+` on %s http:request tasks for one queue behind a drain of 1,000/s (leaky bucket, burst 1) and a quota of 800/s (token bucket, burst 100), with no backlog in Redis: the process from start to exit (config, Redis's clock and backlog, the file read and checked on every CPU, the plan, the JSON printed); and in this process its two parts: the file read and checked through package producer, and `+"`jobs.PlanOf`"+` alone (every task booked on the gates' in-process twins, on the plan's own clock). Median of %d rounds, rows interleaved; CPU is user + system seconds (the process's, or this one's during the step). Load average at the end: %s. The plan: the queue empty %.3f s after its start (%s tasks at the quota's 800/s after its burst of 100).

| step | tasks | seconds | CPU seconds | tasks/s | share of the command |
|---|--:|--:|--:|--:|--:|
| %s | %s | %.3f | %.3f | %s | 1.00 |
| %s (in process) | %s | %.3f | %.3f | %s | %.2f |
| %s (in process) | %s | %.3f | %.3f | %s | %.2f |

`, grouped(planTasks), grouped(planTasks), b.rounds, strings.Join(strings.Fields(string(load))[:3], " "), planned.Queues[0].Seconds, grouped(planTasks),
		"`"+viaBinary+"`", grouped(planTasks), seconds(viaBinary), median(cpu[viaBinary]), grouped(rates[viaBinary]),
		viaRead, grouped(planTasks), seconds(viaRead), median(cpu[viaRead]), grouped(rates[viaRead]), seconds(viaRead)/seconds(viaBinary),
		"`"+viaPlan+"`", grouped(planTasks), seconds(viaPlan), median(cpu[viaPlan]), grouped(rates[viaPlan]), seconds(viaPlan)/seconds(viaBinary))
	return nil
}

// readPlanFile reads and checks the tasks of path as `enqueue plan` does.
func readPlanFile(f config.File, queue, path string) ([]jobs.PlanTask, error) {
	in, err := producer.OpenFile(path)
	if err != nil {
		return nil, err
	}
	defer in.Close()
	var tasks []jobs.PlanTask
	_, err = producer.ReadTasks(in, path, 0, producer.Defaults{Queue: queue, Payloads: f}, time.Now(),
		func(q string) bool { _, ok := f.Jobs.Queues[q]; return ok },
		func(t producer.Task) {
			tasks = append(tasks, jobs.PlanTask{Queue: t.Queue, Type: t.Asynq.Type(), Payload: t.Asynq.Payload()})
		})
	return tasks, err
}
