package config_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"log/slog"
	"os"
	"path/filepath"

	"github.com/alicebob/miniredis/v2"
	"github.com/hibiken/asynq"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/sluicehq/sluice/config"
	"github.com/sluicehq/sluice/jobs"
)

func ExampleLoad() {
	dir, _ := os.MkdirTemp("", "sluice")
	defer os.RemoveAll(dir)
	path := filepath.Join(dir, "config.yaml")
	os.WriteFile(path, []byte(`
worker: {concurency: 4, hold_max: 5}
queues:
  Emails: {priority: 2}
  reports: {drain: {limit: 0, period: 1s}}
`), 0o644)

	_, err := config.Load(path)
	var problems *config.Problems
	if errors.As(err, &problems) {
		for _, err := range problems.Errs {
			var p *config.Problem
			if errors.As(err, &p) { // p.Error() would start with the file's path
				fmt.Printf("line %d: %s: %s\n", p.Line, p.Path, p.Msg)
			}
		}
	}
	// Output:
	// line 2: worker.concurency: unknown key; known keys here are concurrency, metrics_addr, hold_max, reserve_max, waiting, ui
	// line 2: worker.hold_max: must be a duration with a unit, like 1s, 500ms or 5m, got "5"
	// line 0: redis.addr: must be set to host:port, like 127.0.0.1:6379 (or set redis.cluster)
	// line 5: queues.reports.drain.limit: must be > 0, got 0
}

// Sluice's gates added to a program that already runs its own asynq.Server
// and ServeMux: load the config, make a jobs.Scheduler, put its Middleware
// on the mux and build the server from its AsynqConfig (queues, priorities,
// and the hooks that keep a waiting task from being counted as failed), on
// a client with the jobs.EmptyPolls hook.
// Producers stay plain asynq clients.
func Example_asynqServer() {
	// An in-process Redis stands in for yours, so that the example runs anywhere.
	redisServer := miniredis.NewMiniRedis()
	if err := redisServer.Start(); err != nil {
		log.Fatal(err)
	}
	defer redisServer.Close()
	dir, _ := os.MkdirTemp("", "sluice")
	defer os.RemoveAll(dir)
	path := filepath.Join(dir, "config.yaml")
	os.WriteFile(path, []byte(`
redis: {addr: `+redisServer.Addr()+`}
queues:
  emails: {drain: {limit: 20, period: 1s}}
tasks:
  email:send: {}
`), 0o644)

	file, err := config.Load(path)
	if err != nil {
		log.Fatal(err)
	}
	rdb := file.Redis.Client()
	defer rdb.Close()
	sched, err := jobs.NewScheduler(rdb, file.Redis.AsynqOpt(), file.Jobs, jobs.NewMetrics(prometheus.NewRegistry()), slog.Default())
	if err != nil {
		log.Fatal(err)
	}
	defer sched.Close()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go sched.Run(ctx) // the fleet's clock, live workers and upstream blocks

	sent := make(chan string)
	mux := asynq.NewServeMux()
	mux.Use(sched.Middleware)
	mux.HandleFunc("email:send", func(ctx context.Context, t *asynq.Task) error {
		sent <- string(t.Payload())
		return nil
	})
	asynqRDB := file.Redis.Client()
	defer asynqRDB.Close()
	asynqRDB.AddHook(&jobs.EmptyPolls{}) // asynq's polls of an empty queue run no script
	srv := asynq.NewServerFromRedisClient(asynqRDB, sched.AsynqConfig())
	if err := srv.Start(mux); err != nil {
		log.Fatal(err)
	}
	defer srv.Shutdown()

	client := asynq.NewClient(file.Redis.AsynqOpt())
	defer client.Close()
	if _, err := client.Enqueue(asynq.NewTask("email:send", []byte(`{"to": "ann@example.com"}`)), asynq.Queue("emails")); err != nil {
		log.Fatal(err)
	}
	fmt.Println("sent", <-sent)
	// Output: sent {"to": "ann@example.com"}
}
