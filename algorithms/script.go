package algorithms

import (
	"context"
	"crypto/sha1"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"math"
	"strconv"
	"strings"
	"sync"

	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/lua"
)

// Script is a Lua script run by its SHA1 with a fallback to its body when
// Redis does not have it cached (after a restart, a failover or SCRIPT
// FLUSH), so that an empty script cache costs no decision. Where the
// server has Redis 7 functions, it runs as a function instead (FCALL),
// loaded as a library when the server does not have it (after a restart, a
// failover or FUNCTION FLUSH), in the same way: a function's library is
// defined once, where EVALSHA defines all of the script's functions on
// every call. Clients whose server lacks functions (Redis 6, miniredis) or
// whose user may not call them (an ACL without FCALL or FUNCTION LOAD) run
// the script, with the same results.
type Script struct {
	source string
	script *redis.Script
	// allow holds, by algorithm, the lean scripts of one limit's AllowN or
	// ReserveN (see Op.lean); nil for a script without them.
	allow map[string]*redis.Script
	// series runs OpSeries (lua/series.lua); nil for a script without it.
	series       *redis.Script
	seriesSource string
	// function is the script's function (and, with "_allow", the lean
	// one's), its library named after it; "" for a script that runs only
	// as a script.
	function, library string
	// leanFunctions are the library's functions of the lean scripts, by
	// algorithm name, and bookBuckets its two-bucket Book: named once, not
	// on every call.
	leanFunctions map[string]any // boxed once, as allowHashes
	allowHashes   map[string]any // the lean scripts' SHA1s
	bookBuckets   string
	seriesFunc    string
	// scriptsOnly holds the clients that run the script, not the function.
	scriptsOnly sync.Map // redis.UniversalClient -> struct{}
}

func newScript(source string, allow map[string]string, series string, library func(name string) string) *Script {
	s := &Script{source: source, script: redis.NewScript(source)}
	if series != "" {
		s.series, s.seriesSource = redis.NewScript(series), series
	}
	if allow != nil {
		s.allow = map[string]*redis.Script{}
		s.allowHashes = map[string]any{}
		for name, src := range allow {
			s.allow[name] = redis.NewScript(src)
			s.allowHashes[name] = s.allow[name].Hash()
		}
	}
	if library != nil {
		// Named by its text: processes of different versions on one server
		// each call their own, and none replaces another's.
		sum := sha1.Sum([]byte(library("")))
		s.function = "sluice_" + hex.EncodeToString(sum[:8])
		s.library = library(s.function)
		s.bookBuckets = s.function + "_book_buckets"
		s.seriesFunc = s.function + "_series"
		s.leanFunctions = map[string]any{
			FixedWindow.Name: s.function + "_window", SlidingCounter.Name: s.function + "_counter", SlidingLog.Name: s.function + "_log",
			TokenBucket.Name: s.function + "_bucket", LeakyBucket.Name: s.function + "_bucket",
		}
	}
	return s
}

// BookScript runs an operation on the limits of one cluster slot: the
// twin of Book, Series, Peek and the giving back and blocking around them.
var BookScript = newScript(lua.Book, lua.Allow, lua.Series, lua.BookLibrary)

// Source returns the full text of the script.
func (s *Script) Source() string { return s.source }

// Hash returns the script's SHA1, the name EVALSHA knows it by.
func (s *Script) Hash() string { return s.script.Hash() }

// Function returns the name FCALL knows the script by, or "" if it runs as
// a script only.
func (s *Script) Function() string { return s.function }

// Load caches the script, and its lean and series scripts, on the
// server(s) rdb talks to.
func (s *Script) Load(ctx context.Context, rdb redis.Scripter) error {
	if err := s.script.Load(ctx, rdb).Err(); err != nil {
		return err
	}
	if s.series != nil {
		if err := s.series.Load(ctx, rdb).Err(); err != nil {
			return err
		}
	}
	for _, a := range s.allow {
		if err := a.Load(ctx, rdb).Err(); err != nil {
			return err
		}
	}
	return nil
}

// ScriptsOnly makes rdb's calls of s run the script (EVALSHA) even where
// the server has functions: for a server where FUNCTION LOAD is not
// wanted, and for tests of that path.
func (s *Script) ScriptsOnly(rdb redis.UniversalClient) {
	s.scriptsOnly.Store(rdb, struct{}{})
}

// Now asks a script to read Redis's own clock.
const Now int64 = -1

// The operations of the book script (see lua/book.lua).
const (
	OpBook   = "book"   // the twin of Book
	OpCancel = "cancel" // give back every claim's GiveBack
	OpBlock  = "block"  // block every claim's key for NotBefore µs; Result.At is until when
	OpPeek   = "peek"   // the twin of Peek: Remaining, and in RetryAfter how long the key is still blocked
	// OpSeries books a turn for each of Op.Series.IDs, one after another:
	// the twin of Series, run by its own script (lua/series.lua). Its
	// claims have no ID, GiveBack, Member or Replaces; a RecentKey counts
	// what the turns' Books would have counted there (see Series).
	OpSeries = "series"
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
	// Lean, if not nil, is NewLeanArgs of the claim's Algorithm and
	// Params, made once for the limit: the lean script's arguments that do
	// not change from call to call.
	Lean *LeanArgs
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

// SeriesOp is what an OpSeries asks beyond an Op's book (NotBefore,
// MaxWait, Late, Slack), and once run, its outcome: kept apart from Op,
// which every decision allocates, so that they stay small.
type SeriesOp struct {
	// IDs: one turn for each, in order; none may have a turn kept under it.
	IDs []string
	// KeptKeys: where each turn is kept, per turn and claim: the key of
	// claim i's turn t is KeptKeys[t*len(Op.Claims)+i], in the claims' slot.
	KeptKeys []string
	MinAhead int64       // a turn less than this many µs from now is not booked
	Reminds  *RemindEach // where to note the turns, or nil

	Booked []Booking // the turns booked, in order
}

// RemindEach has a series note each turn in a sorted set, in the same run:
// the turn's member (Members[i] for the i-th of SeriesOp.IDs) scored Lead µs
// before the turn, if the turn is more than After µs away; one ZADD for
// all of them.
type RemindEach struct {
	Key         string // in the claims' slot
	Members     []string
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
	// RefusalsOnly: book: recent throttles are counted only where the
	// booking is refused (see throttle.RecentRefusalsOnly).
	RefusalsOnly bool
	Late         int64 // book: how long after its instant a kept turn is still given (µs; < 0: however long)
	KeepAfter    int64 // book: a turn is kept under the claims' IDs only if more than this many µs away
	Slack        int64 // µs added to every TTL the script sets
	Claims       []OpClaim
	Remind       *Remind // book: where to note the turn, or nil
	// NoPieces: the caller gives nothing back (AllowN), so Result's claims
	// are left without Pieces, which would be formatted for nothing.
	NoPieces bool
	Series   *SeriesOp // OpSeries: its turns, and once run what it booked

	Result Booking
	Err    error

	counted [1]Counted // Result.Claims of an op of one claim: no allocation of its own
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
	switch {
	case op.Exact:
		exact = "1"
	case op.RefusalsOnly:
		exact = "2"
	}
	args := make([]any, 0, 9+14*len(op.Claims)+3)
	var notBefore any = op.NotBefore
	if op.Ahead > 0 {
		notBefore = "+" + strconv.FormatInt(op.Ahead, 10)
	}
	args = append(args, clock, op.Name, notBefore, op.MaxWait, exact, op.Slack, op.Late, op.KeepAfter, len(op.Claims))
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

// lean tells whether op is one limit's AllowN or ReserveN that the lean
// script decides as the book script would (lua/allow_*.lua): a book of one
// claim with no ID, nothing to give back, no replaced limit, no recent
// throttles, no fair share and no remind.
func (op *Op) lean() bool {
	if op.Name != OpBook || len(op.Claims) != 1 || op.Exact || op.Ahead > 0 || op.Remind != nil {
		return false
	}
	c := op.Claims[0]
	return c.GiveBack == "" && c.ID == "" && c.RecentKey == "" && c.Replaces == nil && c.Member == ""
}

// LeanArgs holds the arguments of one limit's lean script (leanArgs) that
// do not change from call to call, boxed once: an int64 boxed as a command
// argument allocates, on every call.
type LeanArgs struct {
	params []any // between the clock and the options, for n = 1
	slack  int64
	boxed  any // slack
	last   any // a bucket's limit/g, the last argument; nil for the others
}

// NewLeanArgs returns the lean script's arguments of a limit of a and p
// whose TTLs are slack µs longer (see Op.Slack) that do not change from
// call to call.
func NewLeanArgs(a *Algorithm, p Params, slack int64) *LeanArgs {
	return &LeanArgs{params: leanParams(a, p, 1), slack: slack, boxed: slack, last: leanLast(a, p)}
}

// leanLast is a bucket's last lean argument, limit/g; nil for the others.
func leanLast(a *Algorithm, p Params) any {
	if a == TokenBucket || a == LeakyBucket {
		return p.Limit / gcd(p.Limit, p.Period)
	}
	return nil
}

// leanParams are the lean script's arguments of a limit of a and p for n
// events, between the clock and the options (lua/allow_*.lua).
func leanParams(a *Algorithm, p Params, n int64) []any {
	switch a {
	case TokenBucket, LeakyBucket:
		// The bucket's units, reduced here rather than in Lua on every
		// call, burst and n in them.
		perEvent := p.Period / gcd(p.Limit, p.Period)
		return []any{perEvent, p.Burst * perEvent, n * perEvent}
	case FixedWindow:
		return []any{p.Period, p.Limit - n, n}
	case SlidingCounter:
		return []any{p.Period / p.Windows, p.Windows, p.Limit, n}
	}
	return []any{p.Limit, p.Period, n} // a sliding log
}

// leanCommand is the command name (FCALL, EVALSHA or EVAL) of the lean
// script script on op's one claim: its keys (the state's, and a sliding
// log's aux key) and arguments, in one slice.
func (op *Op) leanCommand(ctx context.Context, name string, script any) *redis.Cmd {
	c := &op.Claims[0]
	args := make([]any, 0, 15)
	if c.Algorithm == SlidingLog {
		args = append(args, name, script, 2, c.Key, c.Aux)
	} else {
		args = append(args, name, script, 1, c.Key)
	}
	cmd := redis.NewCmd(ctx, op.appendLeanArgs(args)...)
	cmd.SetFirstKeyPos(3) // so that a cluster client sends it to its keys' node
	return cmd
}

// appendLeanArgs appends the lean script's arguments of op's one claim to
// args: the clock, the limit's parameters, then the options (TTL slack,
// the longest wait, not before; and a bucket's limit/g), the last of them
// left out where they are 0, or 1 for limit/g (as AllowN's are on Redis's
// clock): fewer arguments to pass and read (lua/allow_*.lua).
func (op *Op) appendLeanArgs(args []any) []any {
	c := &op.Claims[0]
	if op.Now == Now {
		args = append(args, "")
	} else {
		args = append(args, op.Now)
	}
	var slack, last any
	if lean := c.Lean; lean != nil && lean.slack == op.Slack {
		if c.N == 1 {
			args = append(args, lean.params...)
		} else {
			args = append(args, leanParams(c.Algorithm, c.Params, c.N)...)
		}
		slack, last = lean.boxed, lean.last
	} else {
		args = append(args, leanParams(c.Algorithm, c.Params, c.N)...)
		slack, last = op.Slack, leanLast(c.Algorithm, c.Params)
	}
	keep := len(args) // the options after it are left out while they are 0
	args = append(args, slack, op.MaxWait, op.notBefore())
	if last == nil || last == int64(1) {
		return trimZeros(args, keep)
	}
	return append(args, last)
}

// trimZeros leaves out the zeros at the end of args after its first keep:
// the lean scripts read a missing trailing argument as 0.
func trimZeros(args []any, keep int) []any {
	for len(args) > keep && args[len(args)-1] == int64(0) {
		args = args[:len(args)-1]
	}
	return args
}

// bookBuckets tells whether op is a book on two buckets and
// nothing else asked (no ID, nothing to give back, no replaced limit, no
// recent throttles, no fair share, no remind, not exact): a drain's and a
// quota's booking, which the library's book_buckets function decides
// (lua/book_buckets.lua).
func (op *Op) bookBuckets() bool {
	if op.Name != OpBook || len(op.Claims) != 2 || op.Exact || op.Ahead > 0 || op.Remind != nil {
		return false
	}
	for _, c := range op.Claims {
		if c.Algorithm != TokenBucket && c.Algorithm != LeakyBucket ||
			c.GiveBack != "" || c.ID != "" || c.RecentKey != "" || c.Replaces != nil || c.Member != "" {
			return false
		}
	}
	return true
}

func (op *Op) bookBucketsKeys() []string {
	keys := make([]string, len(op.Claims))
	for i, c := range op.Claims {
		keys[i] = c.Key
	}
	return keys
}

// bookBucketsArgs are the clock and the call's numbers and texts, packed
// (lua/book_buckets.lua).
func (op *Op) bookBucketsArgs() []any {
	clock := ""
	if op.Now != Now {
		clock = strconv.FormatInt(op.Now, 10)
	}
	// Doubles, as Lua holds numbers: the values it read from their text before.
	packed := appendDoubles(make([]byte, 0, 12*8+2*20), op.Now)
	var perMicro, needs [2]int64
	for i, c := range op.Claims {
		p := c.Params
		g := gcd(p.Limit, p.Period)
		perEvent := p.Period / g
		packed = appendDoubles(packed, perEvent, p.Burst*perEvent, c.N*perEvent)
		perMicro[i], needs[i] = p.Limit/g, c.N*perEvent
	}
	packed = appendDoubles(packed, op.Slack, op.MaxWait, op.NotBefore, perMicro[0], perMicro[1])
	for _, n := range needs {
		packed = append(strconv.AppendInt(packed, n, 10), 0)
	}
	return []any{clock, packed}
}

// appendDoubles appends each of vs to b as a little-endian double.
func appendDoubles(b []byte, vs ...int64) []byte {
	for _, v := range vs {
		b = binary.LittleEndian.AppendUint64(b, math.Float64bits(float64(v)))
	}
	return b
}

// notBefore is op.NotBefore for the lean scripts, which book from the
// later of it and now: 0 where now is given and not before it, one
// argument fewer.
func (op *Op) notBefore() int64 {
	if op.Now != Now && op.NotBefore <= op.Now {
		return 0
	}
	return op.NotBefore
}

// finish sets op's outcome from the script's reply: a head {ok, now, at}
// and per claim one of three layouts: book.lua's {remaining, retry_after,
// reset_after, pieces}; the buckets' quick steps' (lua/bucket.lua's
// bucket_quick, lua/book_buckets.lua) {remaining, reset_after, ref, from},
// a booking's, its pieces "ref from to" formatted here, to = from + n in
// the bucket's units, rather than by the server; and {remaining,
// reset_after}: allow_window's, allow_counter's and allow_log's booking of
// one claim, its pieces the instant booked, and the buckets' quick
// booking at now where every bucket was empty, its pieces "now 0 n" (in
// units). The first two have one length and are told apart by the pieces'
// type (a string, an integer).
// Read straight into the Booking: this runs on every decision.
func (op *Op) finish(cmd *redis.Cmd) {
	reply, err := cmd.Slice()
	if err != nil {
		op.Err = err
		return
	}
	if op.Name == OpSeries {
		op.Err = op.finishSeries(reply)
		return
	}
	k := len(op.Claims)
	per := 0 // values per claim
	switch len(reply) {
	case 3 + 4*k:
		per = 4
	case 3 + 2*k:
		per = 2
	}
	if per == 0 {
		op.Err = fmt.Errorf("algorithms: book script replied %d values for %d claims, want %d", len(reply), k, 3+4*k)
		return
	}
	var head [3]int64
	if op.Err = intsOf(reply[:3], head[:]); op.Err != nil {
		return
	}
	b := Booking{OK: head[0] >= 1, Kept: head[0] == 2, Reminded: head[0] == 3, Now: head[1], At: head[2]}
	if k == 1 {
		b.Claims = op.counted[:]
	} else {
		b.Claims = make([]Counted, k)
	}
	for i := range b.Claims {
		v, c := reply[3+per*i:3+per*(i+1)], &b.Claims[i]
		var x [4]int64
		if per == 2 {
			op.Err = intsOf(v, x[:2])
			c.Remaining, c.ResetAfter = x[0], x[1]
			switch a := op.Claims[i].Algorithm; {
			case op.NoPieces:
			case a == TokenBucket || a == LeakyBucket: // booked empty at now: ref now, from 0
				p := op.Claims[i].Params
				c.Pieces = joinInts(b.Now, 0, op.Claims[i].N*(p.Period/gcd(p.Limit, p.Period)))
			default:
				c.Pieces = strconv.FormatInt(b.At, 10)
			}
		} else if pieces, ok := v[3].(string); ok {
			op.Err = intsOf(v[:3], x[:3])
			c.Remaining, c.RetryAfter, c.ResetAfter, c.Pieces = x[0], x[1], x[2], pieces
		} else {
			op.Err = intsOf(v, x[:4])
			c.Remaining, c.ResetAfter = x[0], x[1]
			if !op.NoPieces {
				p := op.Claims[i].Params
				need := op.Claims[i].N * (p.Period / gcd(p.Limit, p.Period))
				c.Pieces = joinInts(x[2], x[3], x[3]+need)
			}
		}
		if op.Err != nil {
			return
		}
	}
	op.Result = b
}

// intsOf reads the integers of a script's reply vs into out.
func intsOf(vs []any, out []int64) error {
	for i, v := range vs {
		n, ok := v.(int64)
		if !ok {
			return fmt.Errorf("algorithms: book script replied %v, want an integer", v)
		}
		out[i] = n
	}
	return nil
}

// Run runs ops on rdb and sets the outcome of each: one op as one call,
// several in one pipeline (one write and one read for all of them, each op
// still its own atomic run). Ops that find the function or the script
// missing on the server (which means they did not run) are run again once
// it is loaded. No op is ever sent twice otherwise (see onceCmd): one whose
// connection broke before its reply came has that error, whether or not
// it ran.
func (s *Script) Run(ctx context.Context, rdb redis.UniversalClient, ops ...*Op) {
	if s.function == "" {
		s.runScripts(ctx, rdb, ops)
		return
	}
	if _, ok := s.scriptsOnly.Load(rdb); ok {
		s.runScripts(ctx, rdb, ops)
		return
	}
	s.settle(ctx, rdb, ops, send(ctx, rdb, ops, s.fcall))
}

// settle sets the outcome of the ops whose FCALLs cmds are, sending again
// those that found the function missing or functions refused, which did
// not run.
func (s *Script) settle(ctx context.Context, rdb redis.UniversalClient, ops []*Op, cmds []*redis.Cmd) {
	var missing, noFunctions []*Op
	for i, cmd := range cmds {
		switch err := cmd.Err(); {
		case err == nil:
			ops[i].finish(cmd)
		case redis.HasErrorPrefix(err, "Function not found"):
			missing = append(missing, ops[i])
		case refusesFunctions(err):
			noFunctions = append(noFunctions, ops[i])
		default:
			ops[i].finish(cmd)
		}
	}
	if len(noFunctions) > 0 {
		s.scriptsOnly.Store(rdb, struct{}{})
		s.runScripts(ctx, rdb, noFunctions)
	}
	if len(missing) == 0 {
		return
	}
	if err := s.loadLibrary(ctx, rdb, missing); err != nil {
		if refusesFunctions(err) {
			s.scriptsOnly.Store(rdb, struct{}{})
			s.runScripts(ctx, rdb, missing)
			return
		}
		for _, op := range missing {
			op.Err = fmt.Errorf("algorithms: FUNCTION LOAD: %w", err)
		}
		return
	}
	for i, cmd := range send(ctx, rdb, missing, s.fcall) {
		missing[i].finish(cmd)
	}
}

// RunOne is Run of one op, without Run's slices: the path of every call
// that is not pipelined.
func (s *Script) RunOne(ctx context.Context, rdb redis.UniversalClient, op *Op) {
	_, scripts := s.scriptsOnly.Load(rdb)
	scripts = scripts || s.function == ""
	var cmd *redis.Cmd
	if scripts {
		cmd = s.evalsha(ctx, op)
	} else {
		cmd = s.fcall(ctx, op)
	}
	_ = rdb.Process(ctx, onceCmd{cmd}) // the error is in the cmd
	switch err := cmd.Err(); {
	case err == nil:
		op.finish(cmd)
	case scripts:
		s.settleScripts(ctx, rdb, []*Op{op}, []*redis.Cmd{cmd})
	default:
		s.settle(ctx, rdb, []*Op{op}, []*redis.Cmd{cmd})
	}
}

// refusesFunctions tells whether err says that FCALL or FUNCTION LOAD did
// not run because the server has no functions (Redis 6, miniredis) or the
// user may not use them (ACL); not an error of the function itself.
func refusesFunctions(err error) bool {
	if err == nil {
		return false
	}
	// Only these commands' own refusals: an error raised inside the
	// function (a command it calls refused by ACL, say) may come after it
	// wrote, and must not make the op run again.
	msg := strings.ToLower(err.Error())
	for _, name := range []string{"fcall", "function", "function|load"} {
		for _, q := range []string{"'%s'", "`%s`"} {
			quoted := fmt.Sprintf(q, name)
			if strings.HasPrefix(msg, "err unknown command "+quoted) ||
				(strings.HasPrefix(msg, "noperm") && strings.Contains(msg, "to run the "+quoted+" command") && !strings.Contains(msg, "script")) {
				return true
			}
		}
	}
	return false
}

// loadLibrary loads s's library on the servers that ops' keys are on.
func (s *Script) loadLibrary(ctx context.Context, rdb redis.UniversalClient, ops []*Op) error {
	c, ok := rdb.(*redis.ClusterClient)
	if !ok {
		return rdb.FunctionLoadReplace(ctx, s.library).Err()
	}
	loaded := map[string]bool{}
	for _, op := range ops {
		if len(op.Claims) == 0 {
			continue
		}
		node, err := c.MasterForKey(ctx, op.Claims[0].Key)
		if err != nil {
			return err
		}
		if addr := node.Options().Addr; !loaded[addr] {
			if err := node.FunctionLoadReplace(ctx, s.library).Err(); err != nil {
				return err
			}
			loaded[addr] = true
		}
	}
	return nil
}

// runScripts runs ops by EVALSHA, and by EVAL those that find the script
// cache empty.
func (s *Script) runScripts(ctx context.Context, rdb redis.UniversalClient, ops []*Op) {
	s.settleScripts(ctx, rdb, ops, send(ctx, rdb, ops, s.evalsha))
}

// settleScripts sets the outcome of the ops whose EVALSHAs cmds are,
// running by EVAL those that found the script cache empty, which did not
// run.
func (s *Script) settleScripts(ctx context.Context, rdb redis.UniversalClient, ops []*Op, cmds []*redis.Cmd) {
	var uncached []*Op
	for i, cmd := range cmds {
		if err := cmd.Err(); err != nil && redis.HasErrorPrefix(err, "NOSCRIPT") {
			uncached = append(uncached, ops[i])
			continue
		}
		ops[i].finish(cmd)
	}
	if len(uncached) == 0 {
		return
	}
	// NOSCRIPT means the op did not run; EVAL runs it and caches the script.
	for i, cmd := range send(ctx, rdb, uncached, s.eval) {
		uncached[i].finish(cmd)
	}
}

// send sends the command call makes of each op, one alone, several in one
// pipeline, and returns them, each with its reply or error.
func send(ctx context.Context, rdb redis.UniversalClient, ops []*Op, call func(context.Context, *Op) *redis.Cmd) []*redis.Cmd {
	cmds := make([]*redis.Cmd, len(ops))
	if len(ops) == 1 {
		cmds[0] = call(ctx, ops[0])
		_ = rdb.Process(ctx, onceCmd{cmds[0]}) // the error is in the cmd
		return cmds
	}
	// Every command's error is in its Cmd; Pipelined's is the first of them.
	_, _ = rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		for i, op := range ops {
			cmds[i] = call(ctx, op)
			_ = p.Process(ctx, onceCmd{cmds[i]})
		}
		return nil
	})
	return cmds
}

func (s *Script) fcall(ctx context.Context, op *Op) *redis.Cmd {
	if s.lean(op) {
		return op.leanCommand(ctx, "fcall", s.leanFunctions[op.Claims[0].Algorithm.Name])
	}
	if s.allow != nil && op.bookBuckets() {
		return command(ctx, "fcall", s.bookBuckets, op.bookBucketsKeys(), op.bookBucketsArgs())
	}
	if op.Name == OpSeries {
		return command(ctx, "fcall", s.seriesFunc, op.seriesKeys(), op.seriesArgs())
	}
	return command(ctx, "fcall", s.function, op.keys(), op.args())
}

func (s *Script) evalsha(ctx context.Context, op *Op) *redis.Cmd {
	if s.lean(op) {
		return op.leanCommand(ctx, "evalsha", s.allowHashes[op.Claims[0].Algorithm.Name])
	}
	if op.Name == OpSeries {
		return command(ctx, "evalsha", s.series.Hash(), op.seriesKeys(), op.seriesArgs())
	}
	return command(ctx, "evalsha", s.Hash(), op.keys(), op.args())
}

func (s *Script) eval(ctx context.Context, op *Op) *redis.Cmd {
	if s.lean(op) {
		// redis.Script keeps its source unexported: it is the lean source.
		return op.leanCommand(ctx, "eval", lua.Allow[op.Claims[0].Algorithm.Name])
	}
	if op.Name == OpSeries {
		return command(ctx, "eval", s.seriesSource, op.seriesKeys(), op.seriesArgs())
	}
	return command(ctx, "eval", s.source, op.keys(), op.args())
}

// lean tells whether op runs s's lean script of its algorithm.
func (s *Script) lean(op *Op) bool {
	if s.allow == nil || !op.lean() {
		return false
	}
	_, ok := s.allow[op.Claims[0].Algorithm.Name]
	return ok
}

// command is the command name (FCALL, EVALSHA or EVAL) of script with keys
// and args.
func command(ctx context.Context, name, script string, keys []string, args []any) *redis.Cmd {
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

// seriesKeys are lua/series.lua's KEYS: each claim's state, aux and recent
// keys, then each turn's kept keys, claim by claim, and the remind's set.
func (op *Op) seriesKeys() []string {
	keys := make([]string, 0, 3*len(op.Claims)+len(op.Series.KeptKeys)+1)
	for _, c := range op.Claims {
		recent := c.RecentKey
		if recent == "" {
			recent = c.Aux // a key of the slot: nothing counted
		}
		keys = append(keys, c.Key, c.Aux, recent)
	}
	keys = append(keys, op.Series.KeptKeys...)
	if r := op.Series.Reminds; r != nil {
		keys = append(keys, r.Key)
	}
	return keys
}

// seriesArgs are lua/series.lua's ARGV.
func (op *Op) seriesArgs() []any {
	clock := ""
	if op.Now != Now {
		clock = strconv.FormatInt(op.Now, 10)
	}
	sr := op.Series
	args := make([]any, 0, 8+6*len(op.Claims)+2+len(sr.IDs))
	args = append(args, clock, op.NotBefore, op.MaxWait, sr.MinAhead, op.Slack, op.Late, len(op.Claims), len(sr.IDs))
	for _, c := range op.Claims {
		p := c.Params
		args = append(args, c.Algorithm.Name, p.Limit, p.Period, p.Burst, p.Windows, c.N)
	}
	if r := sr.Reminds; r != nil {
		args = append(args, r.Lead, r.After)
		for _, m := range r.Members {
			args = append(args, m)
		}
	}
	return args
}

// finishSeries sets op.Series.Booked from lua/series.lua's reply: {now, booked,
// then per turn: at, reminded, then per claim: remaining, reset_after,
// pieces}.
func (op *Op) finishSeries(reply []any) error {
	var head [2]int64
	if len(reply) < 2 {
		return fmt.Errorf("algorithms: series script replied %d values, want at least 2", len(reply))
	}
	if err := intsOf(reply[:2], head[:]); err != nil {
		return err
	}
	now, booked, k := head[0], head[1], len(op.Claims)
	per := 2 + 3*k
	if booked < 0 || booked > int64(len(op.Series.IDs)) || int64(len(reply)) != 2+booked*int64(per) {
		return fmt.Errorf("algorithms: series script replied %d values for %d turns booked of %d claims", len(reply), booked, k)
	}
	op.Series.Booked = make([]Booking, booked)
	for t := range op.Series.Booked {
		v := reply[2+t*per : 2+(t+1)*per]
		var turn [2]int64
		if err := intsOf(v[:2], turn[:]); err != nil {
			return err
		}
		b := Booking{OK: true, Reminded: turn[1] == 1, Now: now, At: turn[0], Claims: make([]Counted, k)}
		for i := range b.Claims {
			var x [2]int64
			if err := intsOf(v[2+3*i:4+3*i], x[:]); err != nil {
				return err
			}
			pieces, ok := v[4+3*i].(string)
			if !ok {
				return fmt.Errorf("algorithms: series script replied pieces %v, want a string", v[4+3*i])
			}
			b.Claims[i] = Counted{Remaining: x[0], ResetAfter: x[1], Pieces: pieces, Keep: b.At > now}
		}
		op.Series.Booked[t] = b
	}
	return nil
}
