// Package producer turns task lines and options into checked asynq tasks and
// loads them into Redis: the work behind the enqueue command.
//
// A task is spelled as one line of JSON Lines (see DecodeLine) or as a type,
// a payload and Options (see NewTask); either way it is checked in full
// before anything is written. A Loader enqueues a stream of tasks through a
// bounded pool of goroutines sharing one Redis client and tells, for each,
// whether it is surely in Redis, may be (sent, no answer) or is not; a
// Tally groups those outcomes into the lines to report and resume from.
// CheckTasks and FileTasks read a JSON Lines file twice (check, then load),
// so that what a load holds does not grow with the file:
//
//	d := producer.Defaults{Queue: "default", Payloads: cfg} // cfg: a config.File
//	c, err := producer.CheckTasks(f, "tasks.jsonl", 0, d, now, known) // every line; nothing written
//	f.Seek(0, io.SeekStart)
//	y := producer.NewTally()
//	err = producer.NewLoader(rdb).Load(ctx, producer.FileTasks(f, "tasks.jsonl", 0, d, now), nil, y.Add)
//	if y.Landed() < c.Tasks { return y.FileFailure("tasks.jsonl", "Redis", err) }
package producer
