// Package jobs is sluice's glue to asynq: the built-in job types (payload,
// constructor, handler) and the Scheduler, the middleware that puts every
// task through its gates before its handler runs.
//
// A task meets, in order, the drain gate of its queue (a rate limit,
// leaky_bucket by default: a steady rate), the quota gates of its type
// (shared third-party API quotas, token_bucket by default), then the
// concurrency limits of its queue and type. Each rate gate books the task a
// turn from the limiter's own state (throttle.Reserver): the task runs now,
// waits in the worker for a near turn, or goes back to Redis scheduled for
// its turn and passes without asking again when it comes back. Waiting is
// never a failure: no retry is counted and no task is archived for it.
//
//	sched, err := jobs.NewScheduler(rdb, asynqRedis, cfg, jobs.NewMetrics(reg), log)
//	asynqRDB := redis.NewClient(opts) // asynq's own client
//	asynqRDB.AddHook(&jobs.EmptyPolls{}) // an idle queue's polls run no script
//	srv := asynq.NewServerFromRedisClient(asynqRDB, sched.AsynqConfig())
//	mux := asynq.NewServeMux()
//	mux.Use(sched.Middleware)
//	allow, err := jobs.ParseAllowList(cfg.HTTP.Allow)
//	jobs.Register(mux, allow)
//	go sched.Run(ctx)
//	err = srv.Run(mux)
package jobs
