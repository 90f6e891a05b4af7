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

// The script's operations (see lua/epilogue.lua).
const (
	OpAllow   = "allow"   // the twin of Allow
	OpReserve = "reserve" // the twin of Reserve: Arg is the longest wait, NotBefore the earliest instant
	OpCancel  = "cancel"  // the twin of Cancel: Arg is the reservation's instant
	OpBlock   = "block"   // block the key for Arg µs; Result.At is until when
	OpPeek    = "peek"    // the twin of Peek: Result.Remaining and, in RetryAfter, how long the key is still blocked
)

// Op is one operation of a script on one key, and, once run, its outcome.
type Op struct {
	Call
	Name           string // one of the Op* constants
	Arg, NotBefore int64  // see the Op* constants; 0 where unused

	Result Result
	Err    error
}

func (op *Op) keys() []string { return []string{op.Key, op.BlockKey} }

func (op *Op) args() []any {
	clock := ""
	if op.Now != Now {
		clock = strconv.FormatInt(op.Now, 10)
	}
	p := op.Params
	return []any{clock, p.Limit, p.Period, p.Burst, p.Windows, op.N, op.Slack, op.Name, op.Arg, op.NotBefore}
}

// finish sets op's outcome from the script's reply.
func (op *Op) finish(cmd *redis.Cmd) {
	reply, err := cmd.Int64Slice()
	switch {
	case err != nil:
		op.Err = err
	case len(reply) != 6:
		op.Err = fmt.Errorf("algorithms: script replied %v, want 6 integers", reply)
	default:
		op.Result = Result{
			Allowed:    reply[0] == 1,
			Remaining:  reply[1],
			RetryAfter: reply[2],
			ResetAfter: reply[3],
			Delay:      reply[4],
			At:         reply[5],
		}
	}
}

// Run runs ops on rdb and sets the outcome of each: one op as one script
// call, several in one pipeline (one write and one read for all of them,
// each op still its own atomic script run). Ops that find the script cache
// empty are run again with the script's body.
func (s *Script) Run(ctx context.Context, rdb redis.UniversalClient, ops ...*Op) {
	if len(ops) == 1 {
		ops[0].finish(s.script.Run(ctx, rdb, ops[0].keys(), ops[0].args()...))
		return
	}
	cmds := make([]*redis.Cmd, len(ops))
	// Every command's error is in its Cmd; Pipelined's is the first of them.
	_, _ = rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		for i, op := range ops {
			cmds[i] = s.script.EvalSha(ctx, p, op.keys(), op.args()...)
		}
		return nil
	})
	var uncached []int
	for i, cmd := range cmds {
		if redis.HasErrorPrefix(cmd.Err(), "NOSCRIPT") {
			uncached = append(uncached, i)
			continue
		}
		ops[i].finish(cmd)
	}
	if len(uncached) == 0 {
		return
	}
	// NOSCRIPT means the op did not run; EVAL runs it and caches the script.
	_, _ = rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		for _, i := range uncached {
			cmds[i] = s.script.Eval(ctx, p, ops[i].keys(), ops[i].args()...)
		}
		return nil
	})
	for _, i := range uncached {
		ops[i].finish(cmds[i])
	}
}
