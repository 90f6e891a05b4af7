// Command producer is an example of a producer for sluice: a plain
// asynq.Client that enqueues forecast:fetch tasks, knowing nothing of
// sluice. The workers' gates decide when each task runs.
//
//	go run ./examples/producer --redis 127.0.0.1:6379 --queue forecasts --count 100
package main

import (
	"flag"
	"fmt"
	"os"

	"github.com/hibiken/asynq"

	"github.com/sluicehq/sluice/examples/forecast"
)

func main() {
	addr := flag.String("redis", "127.0.0.1:6379", "the Redis `host:port` the workers use")
	queue := flag.String("queue", "forecasts", "the `queue` to enqueue to")
	count := flag.Int("count", 10, "how many tasks, for the cities city-FIRST to city-FIRST+N-1")
	first := flag.Int("first", 0, "the number of the first city")
	maxRetry := flag.Int("max-retry", 25, "each task's MaxRetry (0: a failure archives it)")
	flag.Parse()
	if *count < 1 || *count > 100_000 {
		fmt.Fprintf(os.Stderr, "producer: --count must be between 1 and 100000, got %d\n", *count)
		os.Exit(2)
	}

	client := asynq.NewClient(asynq.RedisClientOpt{Addr: *addr})
	defer client.Close()
	for i := *first; i < *first+*count; i++ {
		task, err := forecast.NewTask(fmt.Sprintf("city-%d", i))
		if err == nil {
			_, err = client.Enqueue(task, asynq.Queue(*queue), asynq.MaxRetry(*maxRetry))
		}
		if err != nil {
			fmt.Fprintf(os.Stderr, "producer: task %d: %v\n", i, err)
			os.Exit(1)
		}
	}
	fmt.Printf("enqueued %d %s tasks into %s\n", *count, forecast.TypeFetch, *queue)
}
