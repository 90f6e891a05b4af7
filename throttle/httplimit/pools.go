package httplimit

import (
	"context"
	"strings"
	"sync"
	"time"

	"github.com/sluicehq/sluice/throttle"
)

// pools lend the limits' events to requests in batches (throttle.Pool):
// one pool per set of keys a request claims, so that most requests of a
// client far from its limits make no call to Redis. Near a limit a pool
// lends nothing and the request is decided by throttle.Book as usual.
// Keys come from clients (their address, their API key): the pools are
// bounded, and pools idle for a minute are closed first.
type pools struct {
	mu  sync.Mutex
	set map[string]*pooled
}

type pooled struct {
	pool *throttle.Pool // nil: these limits cannot lend (see throttle.NewPool)
	used time.Time
}

const (
	maxPools = 10_000
	poolIdle = time.Minute
)

// take takes one request's events from the pool of claims, reporting
// whether the request may pass and, if it may, each limit's left hint.
func (p *pools) take(ctx context.Context, claims []throttle.Claim) (bool, []int) {
	pool := p.poolOf(claims)
	if pool == nil {
		return false, nil
	}
	if ok, err := pool.Take(ctx); err != nil || !ok {
		return false, nil // the caller books, and its policies apply
	}
	return true, pool.Left()
}

// poolOf returns the pool of claims, making it if there is room.
func (p *pools) poolOf(claims []throttle.Claim) *throttle.Pool {
	var key strings.Builder
	for _, c := range claims {
		key.WriteString(c.Key)
		key.WriteByte(0)
	}
	now := time.Now()
	p.mu.Lock()
	defer p.mu.Unlock()
	if e, ok := p.set[key.String()]; ok {
		e.used = now
		return e.pool
	}
	if len(p.set) >= maxPools {
		p.closeIdle(now)
		if len(p.set) >= maxPools {
			return nil
		}
	}
	pool, err := throttle.NewPool(claims)
	if err != nil {
		pool = nil // not buckets, or too little room: every request books
	}
	p.set[key.String()] = &pooled{pool: pool, used: now}
	return pool
}

// closeIdle closes the pools no request used for poolIdle.
func (p *pools) closeIdle(now time.Time) {
	for key, e := range p.set {
		if now.Sub(e.used) >= poolIdle {
			if e.pool != nil {
				go e.pool.Close() // gives back over Redis: not under the lock
			}
			delete(p.set, key)
		}
	}
}
