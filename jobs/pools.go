package jobs

import (
	"container/list"
	"sync"

	"github.com/sluicehq/sluice/throttle"
)

// maxKeyedPools bounds the pools a gate set keeps for keyed gates. A pool
// lends only while its lease lasts (at most 1s), and a worker runs some
// thousands of tasks a second: a pool that 4,096 other key values' pools
// were used after has mostly seen its lease end, so evicting it gives back
// little. A pool with its lease is under a kilobyte: a few megabytes at
// most.
const maxKeyedPools = 4096

// keyedPools are the pools of keyed gates, one per set of gates, key values
// and cost (gateSet.poolOf): at most capacity, the least recently used evicted
// first, and closed (its lease's unused turns given back).
type keyedPools struct {
	capacity int
	mu       sync.Mutex
	byKey    map[string]*list.Element // of *keyedPool
	order    list.List                // most recently used first
}

type keyedPool struct {
	key  string
	pool *throttle.Pool // nil: these limits cannot lend
}

func newKeyedPools(capacity int) *keyedPools {
	return &keyedPools{capacity: capacity, byKey: map[string]*list.Element{}}
}

// get returns the pool under key, made by newPool if there is none.
func (kp *keyedPools) get(key string, newPool func() *throttle.Pool) *throttle.Pool {
	kp.mu.Lock()
	if e, ok := kp.byKey[key]; ok {
		kp.order.MoveToFront(e)
		kp.mu.Unlock()
		return e.Value.(*keyedPool).pool
	}
	pool := newPool()
	kp.byKey[key] = kp.order.PushFront(&keyedPool{key: key, pool: pool})
	var evicted *throttle.Pool
	if kp.order.Len() > kp.capacity {
		last := kp.order.Remove(kp.order.Back()).(*keyedPool)
		delete(kp.byKey, last.key)
		evicted = last.pool
	}
	kp.mu.Unlock()
	if evicted != nil {
		// Giving back is a round trip to Redis: not on this task's way. A
		// task that took the pool before it was evicted may still lease
		// from it; that lease is given back when its span ends.
		go evicted.Close()
	}
	return pool
}

func (kp *keyedPools) len() int {
	kp.mu.Lock()
	defer kp.mu.Unlock()
	return kp.order.Len()
}

// close closes every pool and forgets them.
func (kp *keyedPools) close() {
	kp.mu.Lock()
	var pools []*throttle.Pool
	for e := kp.order.Front(); e != nil; e = e.Next() {
		if p := e.Value.(*keyedPool).pool; p != nil {
			pools = append(pools, p)
		}
	}
	kp.order.Init()
	clear(kp.byKey)
	kp.mu.Unlock()
	for _, p := range pools {
		p.Close()
	}
}
