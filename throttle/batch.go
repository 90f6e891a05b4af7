package throttle

import (
	"context"
	"slices"
	"sync"

	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/algorithms"
)

// defaultInFlight is how many script calls of one limiter are on the wire
// at once unless WithPipelining says otherwise: enough that a few
// concurrent callers never wait for each other, few enough that a crowd
// shares round trips.
const defaultInFlight = 4

// batchers holds one batcher per Redis client and setting of
// WithPipelining: every limiter on a client shares its round trips.
var batchers sync.Map // batcherKey -> *batcher

type batcherKey struct {
	rdb         redis.UniversalClient
	maxInFlight int
}

func batcherFor(rdb redis.UniversalClient, maxInFlight int) *batcher {
	if b, ok := batchers.Load(batcherKey{rdb, maxInFlight}); ok {
		return b.(*batcher)
	}
	b := &batcher{rdb: rdb, maxInFlight: maxInFlight}
	if _, single := rdb.(*redis.Client); single {
		b.server = &redisSite{calls: b, slot: -1}
	}
	stored, _ := batchers.LoadOrStore(batcherKey{rdb, maxInFlight}, b)
	return stored.(*batcher)
}

// batcher runs the script calls of the Redis limiters on one client. At most maxInFlight round
// trips are out at once. A call made while they are out waits, and when
// one comes back every waiting call goes out together in one pipeline: one
// write and one read, for the client and for the server, instead of one
// each per call (group commit). So under load the cost of a round trip is
// shared, and with fewer than maxInFlight concurrent callers nobody waits.
// Each call is still its own atomic script run.
type batcher struct {
	rdb         redis.UniversalClient
	maxInFlight int // 0: every call goes out at once, alone
	// server is the one site of a single server's claims (nil on a
	// cluster, whose sites are its slots): made once, not on every call.
	server *redisSite

	mu       sync.Mutex
	inFlight int
	waiting  []*waitingOp
}

type waitingOp struct {
	op   *algorithms.Op
	done chan struct{} // closed once op has its outcome
}

// do runs op and sets its outcome. It returns ctx's error, and nothing in
// op, if ctx ends while op waits for its round trip; like any call that
// times out, op may still run.
func (b *batcher) do(ctx context.Context, op *algorithms.Op) error {
	if b.maxInFlight == 0 {
		// Nothing is counted or queued: no lock for every caller to take.
		algorithms.BookScript.RunOne(ctx, b.rdb, op)
		return nil
	}
	b.mu.Lock()
	if b.inFlight < b.maxInFlight {
		b.inFlight++
		b.mu.Unlock()
		algorithms.BookScript.RunOne(ctx, b.rdb, op)
		if batch := b.handOff(); batch != nil {
			// The calls that queued meanwhile go on without this caller.
			go b.drain(context.WithoutCancel(ctx), batch)
		}
		return nil
	}
	w := &waitingOp{op: op, done: make(chan struct{})}
	b.waiting = append(b.waiting, w)
	b.mu.Unlock()
	select {
	case <-w.done:
		return nil
	case <-ctx.Done():
		b.withdraw(w)
		return ctx.Err()
	}
}

// drain runs batches of waiting calls until none are left. The pipeline's
// context is not any one caller's: one caller giving up must not fail the
// others' calls.
func (b *batcher) drain(ctx context.Context, batch []*waitingOp) {
	for batch != nil {
		ops := make([]*algorithms.Op, len(batch))
		for i, w := range batch {
			ops[i] = w.op
		}
		algorithms.BookScript.Run(ctx, b.rdb, ops...)
		for _, w := range batch {
			close(w.done)
		}
		batch = b.handOff()
	}
}

// handOff is called when a round trip has come back: it hands its slot to
// the calls waiting now and returns them, or frees it if there are none.
func (b *batcher) handOff() []*waitingOp {
	b.mu.Lock()
	defer b.mu.Unlock()
	batch := b.waiting
	b.waiting = nil
	if len(batch) == 0 {
		b.inFlight--
		return nil
	}
	return batch
}

// withdraw takes w out of the queue if it has not gone out yet.
func (b *batcher) withdraw(w *waitingOp) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if i := slices.Index(b.waiting, w); i >= 0 {
		b.waiting = slices.Delete(b.waiting, i, i+1)
	}
}
