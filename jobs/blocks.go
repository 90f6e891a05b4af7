package jobs

import (
	"context"
	"errors"
	"fmt"
	"math"
	"net"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/throttle"
)

// blockChannel (rediskeys.go) carries "<quota> <µs>" to every worker when
// an upstream said "not now": tasks that already hold a turn on the quota
// learn of it before they call (new turns are kept out by the quota's own
// block).

// blockBoard is a worker's board of the quotas an upstream blocked: it
// announces this worker's blocks to the fleet (announce, announceKey), and
// its run listens for the fleet's, and reads back those it may have
// missed, until ctx ends.
type blockBoard struct {
	fleetDeps
	logGate throttle.Limiter // failed subscriptions are logged once per 10s

	blocked sync.Map // quota -> time.Time (our clock): an upstream said not before then
	// keys: blocked as in blocked, for values of keyed quotas.
	keys *keyBlocks

	// The same channel tells of changes to the runtime limits
	// (runtimelimits.go): onLimits is called on each, and subscribed each
	// time the board has subscribed (it may have missed some). Either may
	// be nil.
	onLimits, subscribed func()
	// onAdapted, if not nil, is called when a worker changed an adaptive
	// quota's learned rate (adaptedNotice, adapt.go).
	onAdapted func()
	// onShares, if not nil, is called when a sharded queue's shares of
	// its drain changed (sharesNotice, shards.go).
	onShares func()
	// onResigned, if not nil, is called when a queue's waker resigned
	// (resignedNotice, wake.go).
	onResigned func()
}

func newBlockBoard(deps fleetDeps) *blockBoard {
	b := &blockBoard{fleetDeps: deps, keys: newKeyBlocks(maxKeyBlocks)}
	b.logGate, _ = throttle.NewLocal(throttle.Spec{Algorithm: throttle.SlidingLog, Limit: 1, Period: 10 * time.Second})
	return b
}

func (b *blockBoard) run(ctx context.Context) { b.listen(ctx, b.subscribed) }

// listen keeps the board up to date from blockChannel until ctx ends. On
// any error (a silent connection counts, see blockHealthCheck) it
// subscribes again from scratch: go-redis's own reconnect dials the node it
// had, and on Redis Cluster that node may be dead and its replica in its
// place (measured: 49 s of redialling a dead node, 55 of 300 messages
// received). A ClusterClient reloads the cluster's state first, so that
// the new subscription goes to the channel's current node. Each time it has
// subscribed, it reads back from Redis the blocks in force, which it may
// have missed: messages sent while it was not subscribed are lost; then it
// calls readBack, if not nil. The read back runs beside the subscription:
// the connections it takes may be as dead as the one the subscription had,
// and take a while to time out; a new subscription cancels the last one's,
// and listen returns once every read back has.
func (b *blockBoard) listen(ctx context.Context, readBack func()) {
	backoff := blockRetryMin
	if readBack == nil {
		readBack = func() {}
	}
	var reads sync.WaitGroup
	defer reads.Wait()
	cancelRead := func() {}
	defer func() { cancelRead() }()
	subscribed := func() {
		backoff = blockRetryMin
		cancelRead()
		var read context.Context
		read, cancelRead = context.WithCancel(ctx)
		reads.Go(func() {
			b.readBlocks(read)
			readBack()
		})
	}
	for {
		err := b.takeBlocks(ctx, subscribed)
		if ctx.Err() != nil {
			return
		}
		if d, _ := b.logGate.AllowN(context.Background(), "blocks", 1); d.Allowed {
			b.log.Warn("the subscription to upstream blocks failed; subscribing again (further failures in the next 10s are not logged)", "in", backoff, "err", err)
		}
		if cluster, ok := b.rdb.(*redis.ClusterClient); ok {
			cluster.ReloadState(ctx)
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, blockRetryMax)
	}
}

const (
	// blockRetryMin and blockRetryMax bound the wait before subscribing
	// again: soon, since blocks announced meanwhile are not heard, but not
	// in a busy loop while a cluster fails over (a few seconds).
	blockRetryMin = 50 * time.Millisecond
	blockRetryMax = 250 * time.Millisecond
	// blockHealthCheck is how long the subscription may be silent before
	// it is pinged, and how long the ping may go unanswered before the
	// subscription counts as dead: a node whose host died sends nothing,
	// not even the end of the connection.
	blockHealthCheck = time.Second
)

// takeBlocks subscribes to blockChannel and notes every block announced
// until the subscription fails; it returns why. Once subscribed, it calls
// subscribed.
func (b *blockBoard) takeBlocks(ctx context.Context, subscribed func()) error {
	sub := b.rdb.Subscribe(ctx, blockChannel)
	defer sub.Close()
	// A read under way does not watch ctx: closing ends it. Once started,
	// the close is awaited: takeBlocks leaves nothing running.
	closed := make(chan struct{})
	stop := context.AfterFunc(ctx, func() {
		defer close(closed)
		sub.Close()
	})
	defer func() {
		if !stop() {
			<-closed
		}
	}()
	if _, err := sub.Receive(ctx); err != nil { // the subscription's confirmation
		return err
	}
	subscribed()
	pinged := false
	for {
		msg, err := sub.ReceiveTimeout(ctx, blockHealthCheck)
		var netErr net.Error
		silent := errors.As(err, &netErr) && netErr.Timeout() && ctx.Err() == nil
		switch {
		case silent && !pinged:
			if err := sub.Ping(ctx); err != nil {
				return err
			}
			pinged = true
			continue
		case silent:
			return fmt.Errorf("jobs: no answer to a ping on the subscription to blocks within %v: %w", blockHealthCheck, err)
		case err != nil:
			return err
		}
		pinged = false
		m, ok := msg.(*redis.Message)
		switch {
		case !ok:
		case m.Payload == limitsChangedNotice:
			if b.onLimits != nil {
				b.onLimits()
			}
		case m.Payload == adaptedNotice:
			if b.onAdapted != nil {
				b.onAdapted()
			}
		case m.Payload == sharesNotice:
			if b.onShares != nil {
				b.onShares()
			}
		case m.Payload == resignedNotice:
			if b.onResigned != nil {
				b.onResigned()
			}
		default:
			b.takeBlock(m.Payload)
		}
	}
}

// takeBlock notes the block a message of blockChannel announces, if it is
// of a quota of the config in force: "<quota> <µs>", or "<quota> <µs>
// k=<digest>" for one value of a keyed quota (see keyBlock). The quota's
// name is all before the duration: it may hold spaces itself.
func (b *blockBoard) takeBlock(payload string) {
	digest, rest, keyed := parseKeyBlock(payload)
	if keyed {
		payload = rest
	}
	i := strings.LastIndexByte(payload, ' ')
	if i < 0 {
		return
	}
	quota := payload[:i]
	us, err := strconv.ParseInt(payload[i+1:], 10, 64)
	g, known := b.gates().quotas[quota]
	if !known || err != nil || us <= 0 || us > math.MaxInt64/int64(time.Microsecond) || keyed != (g.expr != nil) {
		return
	}
	now := b.clock.Now()
	until := now.Add(time.Duration(us) * time.Microsecond)
	if keyed {
		b.keys.add(keyBlock{quota: quota, digest: digest}, until, now)
		return
	}
	b.block(quota, until)
}

// readBlocks notes the blocks in force on the quotas (Reserver.Peek): set
// while this worker was not subscribed, their messages never reached it.
func (b *blockBoard) readBlocks(ctx context.Context) {
	for _, g := range b.gates().quotas {
		if g.expr != nil {
			continue // a keyed quota's blocks are per key value, in Redis only
		}
		level, err := g.lim.Peek(ctx, g.key)
		if err != nil {
			if ctx.Err() == nil {
				b.log.Warn("cannot read back whether a quota is blocked", "quota", g.key, "err", err)
			}
			continue
		}
		if level.BlockedFor > 0 {
			b.block(g.key, b.clock.Now().Add(level.BlockedFor))
		}
	}
}

// block notes that quota may not be drawn on before until.
func (b *blockBoard) block(quota string, until time.Time) {
	for {
		old, loaded := b.blocked.LoadOrStore(quota, until)
		if !loaded || !until.After(old.(time.Time)) || b.blocked.CompareAndSwap(quota, old, until) {
			return
		}
	}
}

// until is when the block on quota that this worker knows of ends, or the
// zero Time.
func (b *blockBoard) until(quota string) time.Time {
	if v, ok := b.blocked.Load(quota); ok {
		return v.(time.Time)
	}
	return time.Time{}
}

// announce tells the fleet that quota is blocked for block.
func (b *blockBoard) announce(ctx context.Context, quota string, block time.Duration) {
	if err := b.rdb.Publish(ctx, blockChannel, quota+" "+strconv.FormatInt(block.Microseconds(), 10)).Err(); err != nil {
		b.log.Warn("cannot tell the fleet of a blocked quota", "quota", quota, "err", err)
	}
}

// announceKey tells the fleet that one value of a keyed quota is blocked
// for block, naming the value by its digest only (keyBlock).
func (b *blockBoard) announceKey(ctx context.Context, kb keyBlock, block time.Duration) {
	if err := b.rdb.Publish(ctx, blockChannel, kb.announcement(block.Microseconds())).Err(); err != nil {
		b.log.Warn("cannot tell the fleet of a blocked key of a quota", "quota", kb.quota, "err", err)
	}
}

// blockedUntil is the latest block on the quotas of task t, id in queue,
// that this worker knows of, or the zero Time: on a keyed quota, the block
// on the task's key value.
func (s *Scheduler) blockedUntil(gs *gateSet, queue, id string, t *asynq.Task) time.Time {
	var until time.Time
	var vars *taskVars
	now := s.clock.Now()
	for _, g := range gs.routeOf(queue, t.Type()).quotas {
		if g.expr != nil {
			if s.board.keys.empty() {
				continue
			}
			if vars == nil {
				vars = varsOf(queue, id, t)
			}
			if u := s.board.keys.blockedUntil(blockOfKey(g.key, s.claimOf(g, vars).key), now); u.After(until) {
				until = u
			}
			continue
		}
		if u := s.board.until(g.key); u.After(until) {
			until = u
		}
	}
	return until
}
