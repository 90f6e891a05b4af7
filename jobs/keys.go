package jobs

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"net/url"
	"strconv"
	"strings"
	"sync"

	"github.com/google/cel-go/cel"
	"github.com/google/cel-go/common/types"
	"github.com/google/cel-go/common/types/ref"
	"github.com/google/cel-go/ext"
	"github.com/google/cel-go/interpreter"
	"github.com/hibiken/asynq"
	"github.com/tidwall/gjson"
)

// A keyed limit holds separately for every value of its key: a CEL
// expression over the task (payload, type, queue, client) that config.yaml gives
// as `key:` (or `fairness.key`, `concurrency_key`).
const (
	// maxKeyExpr bounds the length of a key expression.
	maxKeyExpr = 1024
	// maxKeyCost bounds the work of one evaluation (CEL's cost units: about
	// one per operation and per element of a string or list looked at).
	maxKeyCost = 10_000
	// maxKeyedPayload is the largest payload decoded for key expressions: a
	// larger one falls into the default key (decoding it would cost more
	// than the task's turn).
	maxKeyedPayload = 1 << 20
	// maxWeights bounds the weights of one queue's fairness.
	maxWeights = 1000
	// maxKeyOverrides bounds the per-key overrides of one limit, the
	// config file's and the runtime ones (runtimelimits.go) together:
	// every worker keeps each as a limiter of its own, about 500 B.
	maxKeyOverrides = 200_000
	// maxKeyName bounds an override's or a weight's key value.
	maxKeyName = 256
	// maxWeight bounds a fairness weight.
	maxWeight = 1000
)

// DefaultKey is the key value of a task whose key expression failed
// (a missing field, a wrong type): one key per limit, counted in
// sluice_key_fallbacks_total.
const DefaultKey = "(default)"

// keyExpr is a compiled key expression.
type keyExpr struct {
	source string
	prg    cel.Program
}

var keyEnv = sync.OnceValues(func() (*cel.Env, error) {
	return cel.NewEnv(
		cel.Variable("payload", cel.DynType),
		cel.Variable("type", cel.StringType),
		cel.Variable("queue", cel.StringType),
		cel.Variable("client", cel.StringType),
		ext.Strings(),
		cel.Function("host",
			cel.Overload("host_string", []*cel.Type{cel.StringType}, cel.StringType, cel.UnaryBinding(celHost))),
	)
})

// compiled caches the programs of the expressions the configs named, so
// that a reload does not compile them again.
var compiled sync.Map // source -> *keyExpr

// compileKey compiles and type-checks a key expression. Its error says
// where in the expression the problem is (line:column, both from 1).
func compileKey(source string) (*keyExpr, error) {
	if k, ok := compiled.Load(source); ok {
		return k.(*keyExpr), nil
	}
	if strings.TrimSpace(source) == "" {
		return nil, errors.New("must be a CEL expression, like payload.tenant or host(payload.url), got an empty one")
	}
	if len(source) > maxKeyExpr {
		return nil, fmt.Errorf("must be at most %d characters, got %d", maxKeyExpr, len(source))
	}
	env, err := keyEnv()
	if err != nil {
		return nil, fmt.Errorf("the CEL environment: %w", err)
	}
	ast, iss := env.Compile(source)
	if iss.Err() != nil {
		var msgs []string
		for _, e := range iss.Errors() {
			msgs = append(msgs, fmt.Sprintf("at %d:%d: %s", e.Location.Line(), e.Location.Column()+1, e.Message))
		}
		return nil, fmt.Errorf("%s (in %q; variables are payload, type, queue and client; functions include host(url))", strings.Join(msgs, "; "), source)
	}
	switch ast.OutputType().String() {
	case "string", "int", "uint", "dyn":
	default:
		return nil, fmt.Errorf("must give a string (or a whole number), but %q gives %s", source, ast.OutputType())
	}
	prg, err := env.Program(ast, cel.CostLimit(maxKeyCost))
	if err != nil {
		return nil, fmt.Errorf("%q: %w", source, err)
	}
	k := &keyExpr{source: source, prg: prg}
	if was, loaded := compiled.LoadOrStore(source, k); loaded {
		return was.(*keyExpr), nil
	}
	return k, nil
}

// taskVars is what a key expression sees of one task; the payload is
// checked once, the first time an expression asks, and read where
// expressions look (see payload.go).
type taskVars struct {
	typ, queue string
	client     string // HeaderClient, "" if not set
	id         string // for the log
	raw        []byte
	checked    bool
	payload    ref.Val
	err        error
}

func newTaskVars(queue, id, typ string, payload []byte) *taskVars {
	return &taskVars{typ: typ, queue: queue, id: id, raw: payload}
}

// HeaderClient is the task header that names the intake's client that
// enqueued the task (enqueue serve sets it on every task it takes, from
// the API key, never from the request): key expressions read it as
// client, so that a limit or a fair share can be per client, which a
// producer cannot spread over many keys as it can a payload's field.
// Tasks enqueued otherwise have it only if their producer set it.
const HeaderClient = "sluice-client"

// varsOf is what a key expression sees of task t, id in queue.
func varsOf(queue, id string, t *asynq.Task) *taskVars {
	v := newTaskVars(queue, id, t.Type(), t.Payload())
	v.client = t.Headers()[HeaderClient]
	return v
}

// check reads the payload for expressions, once: an error if it is too
// large or not JSON (a task takes its limits' default keys then).
func (v *taskVars) check() error {
	if !v.checked {
		v.checked = true
		switch {
		case len(v.raw) > maxKeyedPayload:
			v.err = fmt.Errorf("payload of %d bytes is larger than %d", len(v.raw), maxKeyedPayload)
		case len(v.raw) == 0:
			v.payload = types.NullValue
		case !json.Valid(v.raw):
			var x any
			v.err = fmt.Errorf("payload is not JSON: %w", json.Unmarshal(v.raw, &x))
		default:
			v.payload = jsonVal(gjson.ParseBytes(v.raw))
		}
	}
	return v.err
}

// ResolveName implements interpreter.Activation: the variables of key
// expressions.
func (v *taskVars) ResolveName(name string) (any, bool) {
	switch name {
	case "payload":
		return v.payload, true
	case "type":
		return v.typ, true
	case "queue":
		return v.queue, true
	case "client":
		return v.client, true
	}
	return nil, false
}

// Parent implements interpreter.Activation: there is none.
func (v *taskVars) Parent() interpreter.Activation { return nil }

// eval gives the task's key value, or an error (a missing field, a wrong
// type, a payload that is not JSON).
func (k *keyExpr) eval(v *taskVars) (string, error) {
	if err := v.check(); err != nil {
		return "", err
	}
	out, _, err := k.prg.Eval(v)
	if err != nil {
		return "", err
	}
	switch x := out.Value().(type) {
	case string:
		return keyValue(x), nil
	case int64:
		return strconv.FormatInt(x, 10), nil
	case uint64:
		return strconv.FormatUint(x, 10), nil
	case float64:
		// JSON numbers are doubles: a whole one is a fine key.
		if x == math.Trunc(x) && math.Abs(x) < 1<<53 {
			return strconv.FormatInt(int64(x), 10), nil
		}
	}
	return "", fmt.Errorf("gave %s %v, want a string", out.Type(), out.Value())
}

// keyValue is a string key value as it leaves the evaluation: a copy, at
// most maxKeyName bytes. The evaluation's strings are pieces of the
// payload (payload.go reads it in place, and host() cuts its argument), so
// a key value kept in a map that outlives the task (keyed pools, parked
// views, the local policy's state) would keep the whole payload alive. A
// longer value is named by its hash: distinct values stay distinct, and no
// override or weight could name it anyway (they are at most maxKeyName).
func keyValue(s string) string {
	if len(s) > maxKeyName {
		return hashedKey(s)
	}
	return strings.Clone(s)
}

// hashedKey names key value v by its hash: "sha256:" and the first 16
// bytes of its SHA-256 in hex. A value named so already (keyValue's, or an
// override given by its hashed name) is kept as it is.
func hashedKey(v string) string {
	if isHashedKey(v) {
		return v
	}
	sum := sha256.Sum256([]byte(v))
	return hashedPrefix + hex.EncodeToString(sum[:16])
}

const hashedPrefix = "sha256:"

// isHashedKey reports whether v is a name hashedKey gives.
func isHashedKey(v string) bool {
	h, ok := strings.CutPrefix(v, hashedPrefix)
	if !ok || len(h) != 32 {
		return false
	}
	_, err := hex.DecodeString(h)
	return err == nil && h == strings.ToLower(h)
}

// storedKey is key value v of limit l as the limiter keeps it: hashed with
// hash_keys (DefaultKey excepted: it names no one), else as it is.
func (l LimitConfig) storedKey(v string) string {
	if !l.HashKeys || v == DefaultKey {
		return v
	}
	return hashedKey(v)
}

// celHost is host(url): the URL's host name in lower case, without port.
func celHost(arg ref.Val) ref.Val {
	s, ok := arg.Value().(string)
	if !ok {
		return types.NewErr("host: want a string, got %s", arg.Type())
	}
	u, err := url.Parse(s)
	if err != nil {
		return types.NewErr("host: %v", err)
	}
	if u.Hostname() == "" {
		return types.NewErr("host: %q has no host", s)
	}
	return types.String(strings.ToLower(u.Hostname()))
}

// KeyError is CheckKeys' answer for a task whose key cannot be computed
// for one of its limits.
type KeyError struct {
	Key     string // where config.yaml has the expression: quotas.<name>.key, ...
	Expr    string // the expression
	Problem string // what went wrong: a missing field, a wrong type, ...
	Wait    bool   // the limit's on_key_error is wait
}

func (e *KeyError) Error() string {
	then := "a worker would run it on the limit's default key, shared by every task whose key fails (on_key_error: default)"
	if e.Wait {
		then = "a worker would hold it until its key can be computed (on_key_error: wait)"
	}
	return fmt.Sprintf("the key of %s (%s) cannot be computed for this task: %s; %s", e.Key, e.Expr, e.Problem, then)
}

// CheckKeys evaluates the key expression of every keyed limit a task of
// typ enqueued in queue with payload would meet (its queue's drain, its
// type's quotas), as a worker would, and returns a *KeyError for the first
// that fails. client is the intake's client (HeaderClient), "" if none.
// Producers call it to refuse such a task before it is enqueued. Fairness
// and concurrency_key are not checked: a task whose key fails there takes
// a share or slots of the default key, beside the others, not a limit
// meant for many keys alone.
func CheckKeys(cfg Config, queue, typ string, payload []byte, client string) error {
	type keyed struct{ key, expr, onKeyError string }
	var exprs []keyed
	if q, ok := cfg.Queues[queue]; ok && q.Drain != nil && q.Drain.Key != "" {
		exprs = append(exprs, keyed{"queues." + queue + ".drain.key", q.Drain.Key, q.Drain.OnKeyError})
	}
	for _, name := range cfg.Tasks[typ].Quotas {
		if l := cfg.Quotas[name]; l.Key != "" {
			exprs = append(exprs, keyed{"quotas." + name + ".key", l.Key, l.OnKeyError})
		}
	}
	vars := newTaskVars(queue, "", typ, payload)
	vars.client = client
	for _, k := range exprs {
		expr, err := compileKey(k.expr)
		if err == nil {
			_, err = expr.eval(vars)
		}
		if err != nil {
			return &KeyError{Key: k.key, Expr: k.expr, Problem: err.Error(), Wait: k.onKeyError == OnKeyErrorWait}
		}
	}
	return nil
}
