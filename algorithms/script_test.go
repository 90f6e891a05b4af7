package algorithms_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/algorithms"
	"github.com/sluicehq/sluice/internal/redistest"
)

// A pipeline whose calls find the functions flushed on every master loads
// them on each master its calls go to and runs every call: no decision is
// lost, whichever paths the calls take (the lean one of AllowN and the
// book script).
func TestPipelineAfterFunctionFlushOnCluster(t *testing.T) {
	ctx := context.Background()
	// A cluster of its own: flushing the shared one's functions would make
	// every package's tests beside it load theirs again.
	rdb := redistest.StartCluster(t).Client(t)
	prefix := redistest.Prefix(t)
	for round := range 2 {
		if err := rdb.ForEachMaster(ctx, func(ctx context.Context, m *redis.Client) error {
			return m.FunctionFlush(ctx).Err()
		}); err != nil {
			t.Fatal(err)
		}
		var ops []*algorithms.Op
		for i := range 12 {
			key := fmt.Sprintf("%s{k%d}", prefix, i)
			op := &algorithms.Op{Now: algorithms.Now, Name: algorithms.OpBook, Claims: []algorithms.OpClaim{{
				Algorithm: algorithms.TokenBucket, Params: algorithms.Params{Limit: 10, Period: 1_000_000, Burst: 10},
				Key: key, Aux: key + ":aux", N: 1,
			}}}
			if i%2 == 1 {
				op.Claims[0].ID = fmt.Sprint("turn-", round) // not lean: the book script
				op.Claims[0].KeptKey = key + ":kept"
			}
			ops = append(ops, op)
		}
		algorithms.BookScript.Run(ctx, rdb, ops...)
		for i, op := range ops {
			if op.Err != nil || !op.Result.OK {
				t.Fatalf("round %d, op %d: %+v, %v; want booked", round, i, op.Result, op.Err)
			}
		}
	}
}
