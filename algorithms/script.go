package algorithms

import (
	"context"
	"fmt"
	"strconv"

	"github.com/redis/go-redis/v9"
)

// Script is an algorithm's Lua script, run by its SHA1 with a fallback to
// its body when Redis does not have it cached (after a restart, a failover
// or SCRIPT FLUSH), so that an empty script cache costs no decision.
type Script struct {
	source string
	script *redis.Script
}

func newScript(source string) *Script {
	return &Script{source: source, script: redis.NewScript(source)}
}

// Source returns the full text of the script.
func (s *Script) Source() string { return s.source }

// Hash returns the script's SHA1, the name EVALSHA knows it by.
func (s *Script) Hash() string { return s.script.Hash() }

// Load caches the script on the server(s) rdb talks to.
func (s *Script) Load(ctx context.Context, rdb redis.Scripter) error {
	return s.script.Load(ctx, rdb).Err()
}

// Now asks a script to read Redis's own clock.
const Now int64 = -1

// Call is one run of a script on one key.
type Call struct {
	Key      string // the state's key
	BlockKey string // the key's block, in the same cluster slot
	Params   Params
	Now      int64 // µs, or Now for Redis TIME
	N        int64
	Slack    int64 // µs added to the TTL the script sets
}

// Allow runs the script's "allow" operation: the twin of Allow.
func (s *Script) Allow(ctx context.Context, rdb redis.Scripter, c Call) (Result, error) {
	return s.run(ctx, rdb, c, "allow", 0, 0)
}

// Reserve runs the script's "reserve" operation: the twin of Reserve.
func (s *Script) Reserve(ctx context.Context, rdb redis.Scripter, c Call, notBefore, maxWait int64) (Result, error) {
	return s.run(ctx, rdb, c, "reserve", maxWait, notBefore)
}

// Cancel runs the script's "cancel" operation: the twin of Cancel.
func (s *Script) Cancel(ctx context.Context, rdb redis.Scripter, c Call, at int64) error {
	_, err := s.run(ctx, rdb, c, "cancel", at, 0)
	return err
}

// Peek runs the script's "peek" operation: the twin of Peek.
func (s *Script) Peek(ctx context.Context, rdb redis.Scripter, c Call) (remaining, blockedFor int64, err error) {
	c.N = 1
	r, err := s.run(ctx, rdb, c, "peek", 0, 0)
	return r.Remaining, r.RetryAfter, err
}

// Block runs the script's "block" operation for d µs and returns the µs
// until which the key is blocked.
func (s *Script) Block(ctx context.Context, rdb redis.Scripter, c Call, d int64) (int64, error) {
	r, err := s.run(ctx, rdb, c, "block", d, 0)
	return r.At, err
}

func (s *Script) run(ctx context.Context, rdb redis.Scripter, c Call, op string, arg, notBefore int64) (Result, error) {
	clock := ""
	if c.Now != Now {
		clock = strconv.FormatInt(c.Now, 10)
	}
	p := c.Params
	reply, err := s.script.Run(ctx, rdb, []string{c.Key, c.BlockKey},
		clock, p.Limit, p.Period, p.Burst, p.Windows, c.N, c.Slack, op, arg, notBefore).Int64Slice()
	if err != nil {
		return Result{}, err
	}
	if len(reply) != 6 {
		return Result{}, fmt.Errorf("algorithms: script replied %v, want 6 integers", reply)
	}
	return Result{
		Allowed:    reply[0] == 1,
		Remaining:  reply[1],
		RetryAfter: reply[2],
		ResetAfter: reply[3],
		Delay:      reply[4],
		At:         reply[5],
	}, nil
}
