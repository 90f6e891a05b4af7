package producer

import (
	"hash/fnv"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/hibiken/asynq"

	"github.com/sluicehq/sluice/throttle"
)

// A sharded queue (queues.<q>.shards: N in config.yaml) is N asynq queues,
// its shards, named ShardQueue(q, N, i): "q~0", "q~1", ... asynq keeps
// each queue under one hash tag, its name, so one queue is one Redis
// Cluster master's work; the shards' names are chosen so that their slots
// are spread over the slot space, shard i's slot in the middle half of the
// i-th of N equal parts of it. On a cluster whose masters hold equal runs
// of slots (as redis-cli --cluster create makes them), N shards on N
// masters land one on each; more shards than masters, evenly over them.
// Where "q~i" does not land in its part, the shard is "q~i.k", k the
// smallest number from 1 up that does: a name of one logical queue and
// count is always the same, for every producer and worker.
//
// Producers spread a sharded queue's tasks over its shards (Spread); a
// worker serves every shard. '~' is not allowed in a queue name of
// enqueue's or config.yaml's, so no shard's name is another queue's.

// ShardSep separates a sharded queue's name from its shard's number.
const ShardSep = "~"

// MaxShards bounds queues.<q>.shards.
const MaxShards = 64

// ShardQueue is the asynq queue of shard i (0 <= i < shards) of queue;
// queue itself when shards <= 1.
func ShardQueue(queue string, shards, i int) string {
	if shards <= 1 {
		return queue
	}
	return ShardQueues(queue, shards)[i]
}

// shardNames caches ShardQueues: a name costs a few CRC16s to find.
var shardNames sync.Map // "<shards> <queue>" -> []string

// ShardQueues lists the asynq queues of queue's shards, in shard order;
// [queue] when shards <= 1. The slice is shared: do not change it.
func ShardQueues(queue string, shards int) []string {
	if shards <= 1 {
		return []string{queue}
	}
	cacheKey := strconv.Itoa(shards) + " " + queue
	if names, ok := shardNames.Load(cacheKey); ok {
		return names.([]string)
	}
	names := make([]string, shards)
	for i := range names {
		names[i] = shardName(queue, shards, i)
	}
	shardNames.Store(cacheKey, names)
	return names
}

// shardName finds shard i's name: "q~i", or "q~i.k" for the first k whose
// slot is in the middle half of part i of the slot space (a part is at
// least 256 slots, so about 2N names are tried).
func shardName(queue string, shards, i int) string {
	const slots = 16384
	lo, hi := i*slots/shards, (i+1)*slots/shards
	quarter := (hi - lo) / 4
	base := queue + ShardSep + strconv.Itoa(i)
	for k := 0; ; k++ {
		name := base
		if k > 0 {
			name += "." + strconv.Itoa(k)
		}
		if s := throttle.Slot(name); s >= lo+quarter && s < hi-quarter {
			return name
		}
	}
}

// Spread picks a shard for each task of a sharded queue: round robin per
// queue, from a random start in each process, so that producers that
// enqueue a few tasks each do not all start on shard 0. The zero value
// is ready; it is safe for concurrent use.
type Spread struct {
	next sync.Map // queue -> *atomic.Uint64
}

// Queue returns the asynq queue for the next task of queue with shards
// shards: queue itself when shards <= 1, else one of its shards, each in
// turn.
//
//	q := spread.Queue("emails", 3) // emails~0, emails~1, emails~2, emails~0, ...
//	client.Enqueue(task, asynq.Queue(q))
func (s *Spread) Queue(queue string, shards int) string {
	if shards <= 1 {
		return queue
	}
	c, ok := s.next.Load(queue)
	if !ok {
		n := new(atomic.Uint64)
		n.Store(rand.Uint64N(uint64(shards)))
		c, _ = s.next.LoadOrStore(queue, n)
	}
	i := c.(*atomic.Uint64).Add(1) - 1
	return ShardQueues(queue, shards)[i%uint64(shards)]
}

// Task returns t bound for one of its queue's shards, if the queue has
// shards shards (t as it is if it has one): a task with an id always goes
// to the same shard (its id's hash picks it), so that an id taken in
// the queue is found taken, and so does a unique task (its type's and
// payload's hash), so that asynq finds its twin; any other in turn
// (Queue). t.Queue stays the queue's name; t.Shard and t.Opts name the
// shard.
func (s *Spread) Task(t Task, shards int) Task {
	if shards <= 1 {
		return t
	}
	var shard string
	switch {
	case t.TaskID != "":
		shard = ShardQueues(t.Queue, shards)[hashOf(t.TaskID)%uint64(shards)]
	case t.unique:
		shard = ShardQueues(t.Queue, shards)[hashOf(t.Asynq.Type(), string(t.Asynq.Payload()))%uint64(shards)]
	default:
		shard = s.Queue(t.Queue, shards)
	}
	t.Shard = shard
	t.Opts = append(slices.Clip(t.Opts), asynq.Queue(shard)) // the last queue option is asynq's
	return t
}

// hashOf is FNV-1a of parts, each ended by a zero byte.
func hashOf(parts ...string) uint64 {
	h := fnv.New64a()
	for _, p := range parts {
		h.Write([]byte(p))
		h.Write([]byte{0})
	}
	return h.Sum64()
}

// LogicalQueue is the sharded queue a shard's asynq queue belongs to, and
// the shard's number; queue itself and -1 for a queue that is no shard's
// name.
func LogicalQueue(queue string) (string, int) {
	at := strings.LastIndex(queue, ShardSep)
	if at < 0 {
		return queue, -1
	}
	num, _, _ := strings.Cut(queue[at+1:], ".")
	n, err := strconv.Atoi(num)
	if err != nil || n < 0 || n >= MaxShards || strconv.Itoa(n) != num {
		return queue, -1
	}
	return queue[:at], n
}
