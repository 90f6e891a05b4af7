package jobs

import (
	"net/url"
	"strconv"
	"strings"

	"github.com/sluicehq/sluice/throttle"
)

// Every Redis key and channel of sluice's own that package jobs names is
// built here, under "sluice:"; throttle.Key puts each in the slot of its
// hash tag (a queue's keys in the queue's slot, beside asynq's: see
// asynqlayout.go). A limit's own state lives under the prefix its gate
// gives throttle.

// blockChannel carries "<quota> <µs>" (and keyed blocks) to every worker
// when an upstream said "not now" (blocks.go), and limitsChangedNotice when an
// operator changed a limit live (runtimelimits.go), and adaptedNotice when
// a worker changed an adaptive quota's learned rate (adapt.go), and
// sharesNotice and resignedNotice (shards.go, wake.go): one subscription a
// worker for all. (Its subscription to two channels at once came back
// after a cluster failover without reading back the blocks stored
// meanwhile in 3 of 8 runs of TestBlocksAfterFailover.)
const blockChannel = "sluice:blocked"

// limitPrefix is the prefix of a drain's or quota's state: kind ("drain",
// "quota"), then the version of its spec, so that a changed limit books
// under new keys (gates.go).
func limitPrefix(kind, version string) string { return "sluice:" + kind + ":" + version + ":" }

// fairPrefix is the prefix of a fair queue's shares and lines (fair.go).
const fairPrefix = "sluice:fair:"

// queueSlotsPrefix is the prefix of a queue's concurrency slots;
// typeSlotsPrefix that of a task type's, per key value if it has a
// concurrency_key (gates.go).
const queueSlotsPrefix = "sluice:concurrency:"

func typeSlotsPrefix(taskType string, keyed bool) string {
	if keyed {
		return queueSlotsPrefix + "k:" + url.PathEscape(taskType) + ":"
	}
	return queueSlotsPrefix
}

// wakeKeys are a queue's wake set and its waker's lease (wake.go).
func wakeKeys(queue string) []string {
	return []string{throttle.Key("sluice:wake:", queue), throttle.Key("sluice:waker:", queue)}
}

// rebookClaim is held by the one worker that brings forward the tasks
// booked on the stale gates of a change (wake.go).
func rebookClaim(stale []string) string {
	return throttle.Key("sluice:rebook:", strings.Join(stale, ","))
}

// orphanClaim is held by the one worker that looks for queue's orphans
// now (one claim a queue: fleets of other queues on the server look at
// theirs meanwhile); rescuedKey notes that queue's task id was rescued
// once (fleet.go).
func orphanClaim(queue string) string { return throttle.Key("sluice:rescue:", queue) }

func rescuedKey(queue, id string) string { return throttle.Key("sluice:rescued:", queue) + ":" + id }

// rateKey counts a queue's completions in one bucket of time (rate.go).
func rateKey(queue string, bucket int64) string {
	return throttle.Key("sluice:rate:", queue) + ":" + strconv.FormatInt(bucket, 10)
}

// queueLines keeps the furthest tail of a queue's backlog lines (the member
// "t"); backlogLineKey is one line's, named by a digest of its gate and key
// (backlog.go).
func queueLines(queue string) string { return throttle.Key("sluice:backlog:", queue) }

// handedKey lists the ids of queue's tasks that workers handed to the
// parker unbooked (toParker), the first taken first; in the queue's slot.
func handedKey(queue string) string { return throttle.Key("sluice:handed:", queue) }

func backlogLineKey(queue, digest string) string { return queueLines(queue) + ":" + digest }

// sharesKey holds a sharded queue's shares of its drain: which shards had
// tasks lately ("busy") and for how many looks each had none ("quiet");
// sharerClaim is
// held by the one worker that looks at the shards this time (shards.go).
// Both are under the logical queue's name: one small hash a queue, read by
// every worker a few times a second.
func sharesKey(queue string) string   { return throttle.Key("sluice:shares:", queue) }
func sharerClaim(queue string) string { return throttle.Key("sluice:sharer:", queue) }
