package producer_test

import (
	"fmt"
	"time"

	"github.com/sluicehq/sluice/config"
	"github.com/sluicehq/sluice/producer"
)

// A line's own queue and options win over the defaults; a mistake names
// its key.
func ExampleDecodeLine() {
	d := producer.Defaults{Queue: "bulk", Payloads: config.File{}} // the built-in task types only
	now := time.Date(2030, 1, 2, 15, 4, 5, 0, time.UTC)

	t, err := producer.DecodeLine([]byte(`{"type": "demo:sleep", "payload": {"ms": 5}, "options": {"task_id": "r-1"}}`), d, now)
	fmt.Println(t.Asynq.Type(), t.Queue, t.TaskID, err)

	_, err = producer.DecodeLine([]byte(`{"type": "demo:sleep", "queue": "emails", "options": {"timeout": "1.5s"}}`), d, now)
	fmt.Println(err)
	// Output:
	// demo:sleep bulk r-1 <nil>
	// options.timeout: must be a whole number of seconds (asynq keeps seconds), got 1.5s
}

// A program that enqueues with a plain asynq.Client spreads a sharded
// queue's tasks over its shards (queues.emails.shards: 3 in config.yaml)
// with a Spread: each task to the next shard.
func ExampleSpread() {
	var spread producer.Spread // one for the program, shared by its goroutines
	seen := map[string]bool{}
	for range 3 {
		q := spread.Queue("emails", 3) // then: client.Enqueue(task, asynq.Queue(q))
		seen[q] = true
	}
	fmt.Println(len(seen), producer.ShardQueues("emails", 3))
	// Output:
	// 3 [emails~0.2 emails~1.4 emails~2.3]
}
