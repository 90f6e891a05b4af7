package producer

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"slices"
	"strings"
	"time"
	"unicode"

	"github.com/hibiken/asynq"

	"github.com/sluicehq/sluice/internal/strictjson"
)

// taskLine is one task as a line of JSON Lines (enqueue --file, a POST to
// the intake) spells it:
//
//	{"type": "http:request", "payload": {"url": "https://example.com/"}, "queue": "emails", "options": {"max_retry": 3}}
//
// Only type is required; queue defaults to Defaults.Queue.
type taskLine struct {
	Type    string          `json:"type"`
	Payload json.RawMessage `json:"payload"`
	Queue   *string         `json:"queue"`
	Options json.RawMessage `json:"options"`
}

// Options are a task's options as written, by flags (--max-retry) or in a
// line's options (max_retry); nil is not set. Durations are strings with a
// unit ("30s"), times RFC 3339 ("2030-01-02T15:04:05Z"). The zero value
// sets none.
type Options struct {
	ProcessIn *string `json:"process_in"`
	ProcessAt *string `json:"process_at"`
	MaxRetry  *int    `json:"max_retry"`
	Timeout   *string `json:"timeout"`
	Deadline  *string `json:"deadline"`
	Unique    *string `json:"unique"`
	TaskID    *string `json:"task_id"`
	Retention *string `json:"retention"`
	Group     *string `json:"group"`
}

var (
	lineKeys   = jsonKeys[taskLine]()
	optionKeys = jsonKeys[Options]()
)

// Over returns v with every option that line sets taken from line. The
// time to run is one setting: a line's process_in replaces a flag's
// --process-at and the other way round.
func (v Options) Over(line Options) Options {
	if line.ProcessIn != nil || line.ProcessAt != nil {
		v.ProcessIn, v.ProcessAt = nil, nil
	}
	base, top := reflect.ValueOf(&v).Elem(), reflect.ValueOf(line)
	for i := range top.NumField() {
		if !top.Field(i).IsNil() {
			base.Field(i).Set(top.Field(i))
		}
	}
	return v
}

// CheckedOptions are Options that passed Check, ready for NewTask. The
// zero value sets none.
type CheckedOptions struct {
	opts   []asynq.Option
	taskID string // "" unless set
	group  string // "" unless set
	unique bool   // asynq.Unique is set
}

// Check checks v at now and returns its asynq options, or one error per
// problem, each naming its key as spell spells it (--max-retry or
// options.max_retry).
func (v Options) Check(spell func(key string) string, now time.Time) (CheckedOptions, []error) {
	var o CheckedOptions
	var errs []error
	bad := func(key, format string, args ...any) {
		errs = append(errs, fmt.Errorf("%s: %s", spell(key), fmt.Sprintf(format, args...)))
	}
	duration := func(key string, s *string, min time.Duration, wholeSeconds bool) (time.Duration, bool) {
		if s == nil {
			return 0, false
		}
		d, err := time.ParseDuration(*s)
		switch {
		case err != nil:
			bad(key, "must be a duration with a unit, like 30s, 5m or 2h, got %q", *s)
		case d < 0:
			bad(key, "must not be negative, got %v", d)
		case d < min:
			bad(key, "must be at least %v, got %v", min, d)
		case wholeSeconds && d%time.Second != 0:
			// asynq keeps it in whole seconds and would cut it short.
			bad(key, "must be a whole number of seconds (asynq keeps seconds), got %v", d)
		default:
			return d, true
		}
		return 0, false
	}
	instant := func(key string, s *string) (time.Time, bool) {
		if s == nil {
			return time.Time{}, false
		}
		t, err := time.Parse(time.RFC3339, *s)
		if err != nil {
			bad(key, "must be an RFC 3339 time, like 2030-01-02T15:04:05Z or 2030-01-02T16:04:05+01:00, got %q", *s)
			return time.Time{}, false
		}
		return t, true
	}
	name := func(key string, s *string) (string, bool) {
		if s == nil {
			return "", false
		}
		if err := checkName(*s); err != nil {
			bad(key, "%v", err)
			return "", false
		}
		return *s, true
	}

	if v.ProcessIn != nil && v.ProcessAt != nil {
		bad("process_in", "cannot be used with %s: both say when the task runs; give one", spell("process_at"))
	} else if d, ok := duration("process_in", v.ProcessIn, 0, false); ok {
		o.opts = append(o.opts, asynq.ProcessIn(d))
	} else if t, ok := instant("process_at", v.ProcessAt); ok {
		o.opts = append(o.opts, asynq.ProcessAt(t))
	}
	if v.MaxRetry != nil {
		if *v.MaxRetry < 0 {
			bad("max_retry", "must be >= 0, got %d", *v.MaxRetry)
		} else {
			o.opts = append(o.opts, asynq.MaxRetry(*v.MaxRetry))
		}
	}
	if d, ok := duration("timeout", v.Timeout, time.Second, true); ok {
		o.opts = append(o.opts, asynq.Timeout(d))
	}
	if t, ok := instant("deadline", v.Deadline); ok {
		if !t.After(now) {
			bad("deadline", "%s is not in the future: the task could never run", *v.Deadline)
		} else {
			o.opts = append(o.opts, asynq.Deadline(t))
		}
	}
	if d, ok := duration("unique", v.Unique, time.Second, true); ok {
		o.opts = append(o.opts, asynq.Unique(d))
		o.unique = true
	}
	if id, ok := name("task_id", v.TaskID); ok {
		if len(id) > MaxTaskID {
			bad("task_id", "is %d bytes long; task ids are at most %d bytes", len(id), MaxTaskID)
		} else {
			o.opts = append(o.opts, asynq.TaskID(id))
			o.taskID = id
		}
	}
	if d, ok := duration("retention", v.Retention, 0, true); ok {
		o.opts = append(o.opts, asynq.Retention(d))
	}
	if g, ok := name("group", v.Group); ok {
		o.opts = append(o.opts, asynq.Group(g))
		o.group = g
	}
	return o, errs
}

// Task is one checked task, ready to enqueue.
type Task struct {
	Line   int // its line in a file (set by FileTasks), or a copy's number; reports name tasks by it
	Queue  string
	TaskID string // "" unless set
	Group  string // "" unless set
	// Shard is the asynq queue of Queue's shards it goes to (Spread.Task),
	// "" for an unsharded queue: Opts name it.
	Shard  string
	Asynq  *asynq.Task
	Opts   []asynq.Option // the queue's included
	unique bool           // asynq.Unique is among Opts
}

// PayloadChecker knows the task types and checks their payloads: a
// config.File, from the built-in types' rules and the config's schemas,
// and the keys of the keyed limits a task would meet.
type PayloadChecker interface {
	CheckPayload(typ string, payload []byte) error
	CheckKeys(queue, typ string, payload []byte) error
	TaskTypes() []string
}

// NewTask checks typ and payload with check (its schema, and its keys in
// queue) and returns the task, in queue with options o. An empty payload
// is none. queue is taken as given: check it with CheckQueue.
func NewTask(typ string, payload []byte, queue string, o CheckedOptions, check PayloadChecker) (Task, error) {
	if len(bytes.TrimSpace(payload)) == 0 {
		payload = nil
	}
	if err := check.CheckPayload(typ, payload); err != nil {
		return Task{}, err
	}
	if payload != nil {
		// Compact, so that equal payloads are equal bytes (--unique).
		var b bytes.Buffer
		if err := json.Compact(&b, payload); err != nil {
			return Task{}, fmt.Errorf("%s: payload: %w", typ, err)
		}
		payload = b.Bytes()
	}
	if err := check.CheckKeys(queue, typ, payload); err != nil {
		return Task{}, err
	}
	opts := append(slices.Clip(o.opts), asynq.Queue(queue))
	return Task{Queue: queue, TaskID: o.taskID, Group: o.group, unique: o.unique, Asynq: asynq.NewTask(typ, payload), Opts: opts}, nil
}

// Defaults are what every line gets that does not set it itself: the
// flags' queue and options, and the config's task types.
type Defaults struct {
	Queue    string
	Options  Options // checked already: their problems are not reported per line
	Payloads PayloadChecker
}

// DecodeLine decodes and checks one task line at now:
//
//	{"type": "http:request", "payload": {"url": "https://example.com/"}, "queue": "emails", "options": {"max_retry": 3}}
//
// Only type is required. Its errors name the key or the byte at fault; a
// line with several bad options reports each, joined.
func DecodeLine(data []byte, d Defaults, now time.Time) (Task, error) {
	var l taskLine
	if err := decodeStrict(data, &l, "", lineKeys, "unknown key %q; the keys of a line are %s"); err != nil {
		return Task{}, err
	}
	if l.Type == "" {
		return Task{}, errors.New(`"type" is required: a task type, one of ` + strings.Join(d.Payloads.TaskTypes(), ", "))
	}
	queue := d.Queue
	if l.Queue != nil {
		if err := CheckQueue(*l.Queue); err != nil {
			return Task{}, fmt.Errorf("queue: %w", err)
		}
		queue = *l.Queue
	}
	var line Options
	if len(l.Options) > 0 && string(l.Options) != "null" {
		if err := decodeStrict(l.Options, &line, "options", optionKeys, "unknown option %q; options are %s"); err != nil {
			return Task{}, err
		}
	}
	o, errs := d.Options.Over(line).Check(func(key string) string { return "options." + key }, now)
	if len(errs) > 0 {
		return Task{}, errors.Join(errs...)
	}
	payload := l.Payload
	if string(payload) == "null" {
		payload = nil
	}
	return NewTask(l.Type, payload, queue, o, d.Payloads)
}

// decodeStrict decodes data, one JSON object, into v, refusing unknown keys
// and data after the object. Its errors name the byte at fault, or the key
// prefixed with at (options.max_retry); an unknown key is reported with
// unknown, given the key and the known keys.
func decodeStrict(data []byte, v any, at string, known []string, unknown string) error {
	key := func(field string) string {
		if at == "" {
			return field
		}
		if field == "" {
			return at
		}
		return at + "." + field
	}
	err := strictjson.Decode(data, v)
	var bad *strictjson.Error
	if !errors.As(err, &bad) {
		return err
	}
	switch bad.Problem {
	case strictjson.Truncated:
		return fmt.Errorf("invalid JSON at byte %d: unexpected end of line", bad.Offset)
	case strictjson.NotObject:
		return fmt.Errorf("%swant a JSON object, got %s", prefix(key("")), bad.Got)
	case strictjson.WrongType:
		return fmt.Errorf("%s: want %s, got %s", key(bad.Field), want(bad.Field, bad.Type), bad.Got)
	case strictjson.UnknownField:
		return fmt.Errorf("%s"+unknown, prefix(key("")), bad.Field, strings.Join(known, ", "))
	case strictjson.Trailing:
		return fmt.Errorf("invalid JSON at byte %d: data after the object (one task per line)", bad.Offset)
	}
	return bad
}

func prefix(key string) string {
	if key == "" {
		return ""
	}
	return key + ": "
}

// want says what the JSON value of field, of Go type t, must be.
func want(field string, t reflect.Type) string {
	switch field {
	case "process_in", "timeout", "unique", "retention":
		return `a duration string with a unit, like "30s"`
	case "process_at", "deadline":
		return `an RFC 3339 time string, like "2030-01-02T15:04:05Z"`
	}
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	switch t.Kind() {
	case reflect.Int:
		return "a whole number"
	case reflect.String:
		return "a string"
	}
	return "a JSON " + t.String()
}

// jsonKeys lists the JSON keys of struct type T in order.
func jsonKeys[T any]() []string {
	var keys []string
	for f := range reflect.TypeFor[T]().Fields() {
		keys = append(keys, strings.Split(f.Tag.Get("json"), ",")[0])
	}
	return keys
}

// CheckQueue says what is wrong with a queue name, if anything. asynq
// takes any name (case counts: Emails is not emails), but a brace would
// move the queue's keys to another Redis Cluster slot than its hash tag
// says.
func CheckQueue(name string) error {
	switch {
	case name == "":
		return errors.New("must not be empty")
	case len(name) > 100:
		return fmt.Errorf("%q is %d bytes long; queue names are at most 100", name, len(name))
	}
	for _, r := range name {
		if !('a' <= r && r <= 'z' || 'A' <= r && r <= 'Z' || '0' <= r && r <= '9' || strings.ContainsRune(".-_:", r)) {
			return fmt.Errorf("%q: queue names are letters, digits, '.', '-', '_' and ':'; %q is not allowed", name, r)
		}
	}
	return nil
}

// MaxTaskID bounds the task ids a task may set, in bytes. (Workers run
// tasks with longer ids from other producers too.)
const MaxTaskID = 1024

// checkName checks a task id or group name: asynq refuses blank ones, and
// control characters would garble every listing of them.
func checkName(s string) error {
	if strings.TrimSpace(s) == "" {
		return fmt.Errorf("must not be empty or blank, got %q", s)
	}
	if strings.IndexFunc(s, unicode.IsControl) >= 0 {
		return fmt.Errorf("must not contain control characters, got %q", s)
	}
	return nil
}
