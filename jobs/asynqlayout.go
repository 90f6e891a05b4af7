// asynq v0.26's key layout, which sluice reads and writes directly where
// asynq's API cannot do it cheaply: lua/ready.lua moves a task to the head
// of pending, and the orphan rescue counts the archived. asynqlayout_test.go
// pins it against the asynq version in go.mod.

package jobs

// asynqKeys is the prefix of queue's keys in asynq v0.26's layout
// (internal/base), for what its API cannot do cheaply.
func asynqKeys(queue string) string { return "asynq:{" + queue + "}:" }
