package algorithms

import (
	"context"
	"fmt"
	"strconv"

	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/lua"
)

// Script is a Lua script run by its SHA1 with a fallback to its body when
// Redis does not have it cached (after a restart, a failover or SCRIPT
// FLUSH), so that an empty script cache costs no decision.
type Script struct {
	source string
	script *redis.Script
}

func newScript(source string) *Script {
	return &Script{source: source, script: redis.NewScript(source)}
}

// BookScript runs an operation on the limits of one cluster slot: the
// twin of Book, Peek and the giving back and blocking around them.
var BookScript = newScript(lua.Book)

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

// The operations of the book script (see lua/book.lua).
const (
	OpBook   = "book"   // the twin of Book
	OpCancel = "cancel" // give back every claim's GiveBack
	OpBlock  = "block"  // block every claim's key for NotBefore µs; Result.At is until when
	OpPeek   = "peek"   // the twin of Peek: Remaining, and in RetryAfter how long the key is still blocked
)

// OpClaim is one claim of an Op: n events on one key.
type OpClaim struct {
	Algorithm *Algorithm
	Params    Params
	Key, Aux  string // the state's key and its second key, in one cluster slot
	N         int64
	GiveBack  string // pieces to give back first, or ""
	ID        string // the turn's ID, or ""
	KeptKey   string // where the turn kept under ID lives, in the same slot
	Member    string // FairShare: the key value whose share it is; "" otherwise
	// RecentKey, if not "", is where the claim's recent throttles are
	// counted (a book that cannot have the events at the instant asked, by
	// this claim's own limit), in the same slot.
	RecentKey string
	// Replaces, if not nil, is the limit this claim's replaces: a state
	// that counts nothing takes over what it counted (TakeOver).
	Replaces *Replaced
}

// Replaced is a limit that another replaced (a live change), as a claim
// of the new one sees it: its algorithm (the same as the claim's), params
// and state keys, in the claim's slot.
type Replaced struct {
	Algorithm *Algorithm
	Params    Params
	Key, Aux  string
}

// Remind has a book note its turn in a sorted set, in the same run: Member
// scored Lead µs before the turn, if the turn is more than After µs away.
type Remind struct {
	Key, Member string // Key in the claims' slot
	Lead, After int64
}

// Op is one run of the book script and, once run, its outcome.
type Op struct {
	Now       int64 // µs, or Now for Redis TIME
	Name      string
	NotBefore int64 // book: the earliest instant; block: the block's length
	Ahead     int64 // book: > 0: the earliest instant is the script's now + Ahead µs instead
	MaxWait   int64 // book
	Exact     bool  // book: the turn must be at NotBefore
	Late      int64 // book: how long after its instant a kept turn is still given (µs; < 0: however long)
	Slack     int64 // µs added to every TTL the script sets
	Claims    []OpClaim
	Remind    *Remind // book: where to note the turn, or nil

	Result Booking
	Err    error
}

func (op *Op) keys() []string {
	keys := make([]string, 0, 6*len(op.Claims)+1)
	for _, c := range op.Claims {
		kept, recent := c.KeptKey, c.RecentKey
		if c.ID == "" {
			kept = c.Aux // a key of the slot, untouched
		}
		if recent == "" {
			recent = c.Aux // the same: nothing counted
		}
		oldKey, oldAux := c.Aux, c.Aux // the same: nothing taken over
		if r := c.Replaces; r != nil {
			oldKey, oldAux = r.Key, r.Aux
		}
		keys = append(keys, c.Key, c.Aux, kept, recent, oldKey, oldAux)
	}
	if op.Remind != nil {
		keys = append(keys, op.Remind.Key)
	}
	return keys
}

func (op *Op) args() []any {
	clock := ""
	if op.Now != Now {
		clock = strconv.FormatInt(op.Now, 10)
	}
	exact := "0"
	if op.Exact {
		exact = "1"
	}
	args := make([]any, 0, 8+14*len(op.Claims)+3)
	var notBefore any = op.NotBefore
	if op.Ahead > 0 {
		notBefore = "+" + strconv.FormatInt(op.Ahead, 10)
	}
	args = append(args, clock, op.Name, notBefore, op.MaxWait, exact, op.Slack, op.Late, len(op.Claims))
	for _, c := range op.Claims {
		p := c.Params
		args = append(args, c.Algorithm.Name, p.Limit, p.Period, p.Burst, p.Windows, c.N, c.GiveBack, c.ID, c.Member)
		if r := c.Replaces; r != nil {
			q := r.Params
			args = append(args, r.Algorithm.Name, q.Limit, q.Period, q.Burst, q.Windows)
		} else {
			args = append(args, "", 0, 0, 0, 0)
		}
	}
	if r := op.Remind; r != nil {
		args = append(args, r.Member, r.Lead, r.After)
	}
	return args
}

// finish sets op's outcome from the script's reply.
func (op *Op) finish(cmd *redis.Cmd) {
	reply, err := cmd.Slice()
	if err != nil {
		op.Err = err
		return
	}
	if len(reply) != 3+4*len(op.Claims) {
		op.Err = fmt.Errorf("algorithms: book script replied %d values for %d claims, want %d", len(reply), len(op.Claims), 3+4*len(op.Claims))
		return
	}
	ints := make([]int64, 0, 3+3*len(op.Claims))
	var pieces []string
	for i, v := range reply {
		if i >= 3 && (i-3)%4 == 3 {
			s, ok := v.(string)
			if !ok {
				op.Err = fmt.Errorf("algorithms: book script replied %v for pieces, want a string", v)
				return
			}
			pieces = append(pieces, s)
			continue
		}
		n, ok := v.(int64)
		if !ok {
			op.Err = fmt.Errorf("algorithms: book script replied %v, want an integer", v)
			return
		}
		ints = append(ints, n)
	}
	b := Booking{OK: ints[0] >= 1, Kept: ints[0] == 2, Reminded: ints[0] == 3, Now: ints[1], At: ints[2], Claims: make([]Counted, len(op.Claims))}
	for i := range b.Claims {
		v := ints[3+3*i:]
		b.Claims[i] = Counted{Remaining: v[0], RetryAfter: v[1], ResetAfter: v[2], Pieces: pieces[i]}
	}
	op.Result = b
}

// Run runs ops on rdb and sets the outcome of each: one op as one script
// call, several in one pipeline (one write and one read for all of them,
// each op still its own atomic script run). Ops that find the script cache
// empty are run again with the script's body. No op is ever sent twice
// (see onceCmd): one whose connection broke before its reply came has
// that error, whether or not it ran.
func (s *Script) Run(ctx context.Context, rdb redis.UniversalClient, ops ...*Op) {
	if len(ops) == 1 {
		cmd := s.call(ctx, "evalsha", ops[0])
		_ = rdb.Process(ctx, onceCmd{cmd}) // the error is in cmd
		if redis.HasErrorPrefix(cmd.Err(), "NOSCRIPT") {
			cmd = s.call(ctx, "eval", ops[0])
			_ = rdb.Process(ctx, onceCmd{cmd})
		}
		ops[0].finish(cmd)
		return
	}
	cmds := make([]*redis.Cmd, len(ops))
	// Every command's error is in its Cmd; Pipelined's is the first of them.
	_, _ = rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		for i, op := range ops {
			cmds[i] = s.call(ctx, "evalsha", op)
			_ = p.Process(ctx, onceCmd{cmds[i]})
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
			cmds[i] = s.call(ctx, "eval", ops[i])
			_ = p.Process(ctx, onceCmd{cmds[i]})
		}
		return nil
	})
	for _, i := range uncached {
		ops[i].finish(cmds[i])
	}
}

// call is the EVALSHA (by the script's hash) or EVAL (with its body) of op.
func (s *Script) call(ctx context.Context, name string, op *Op) *redis.Cmd {
	script := s.Hash()
	if name == "eval" {
		script = s.source
	}
	keys, args := op.keys(), op.args()
	cmdArgs := make([]any, 0, 3+len(keys)+len(args))
	cmdArgs = append(cmdArgs, name, script, len(keys))
	for _, k := range keys {
		cmdArgs = append(cmdArgs, k)
	}
	cmd := redis.NewCmd(ctx, append(cmdArgs, args...)...)
	cmd.SetFirstKeyPos(3) // so that a cluster client sends it to its keys' node
	return cmd
}

// onceCmd is a script call that go-redis never sends again. By default
// go-redis sends a command again when the connection broke before its
// reply came (io.EOF, a reset, a timeout): a *redis.Client up to
// MaxRetries times (0 means 3), and a *redis.ClusterClient up to
// MaxRedirects times (0 means 3) whatever its MaxRetries. But the command
// may have run: a script that counts events would count them twice, and one
// that gives them back would give them back twice. go-redis skips that
// retry, for single commands and pipelines alike, on both clients, for a
// command whose NoRetry reports true; answers that say the command did not
// run (MOVED, ASK, READONLY) are still followed.
//
// This way the limiters hold on any client, whatever its options, and the
// caller's other commands keep their retries; refusing clients that retry
// would not do, since a ClusterClient retries with MaxRetries -1 too.
type onceCmd struct{ *redis.Cmd }

// NoRetry implements redis.Cmder.
func (onceCmd) NoRetry() bool { return true }
