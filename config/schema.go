package config

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"maps"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/santhosh-tekuri/jsonschema/v6"
	"golang.org/x/text/language"
	"golang.org/x/text/message"

	"github.com/sluicehq/sluice/jobs"
)

const (
	// maxSchemaSize bounds a schema file, and each file it refers to: a
	// schema describes one payload; megabytes of it are a mistake.
	maxSchemaSize = 1 << 20
	// maxViolations is how many violations of a schema a PayloadError
	// keeps; the rest are counted.
	maxViolations = 10
)

// compileSchemas compiles the schema of every task type of f that names
// one (tasks.<type>.schema, relative to dir, the config file's directory)
// and returns them by type, with one problem per schema that is missing,
// too large, not JSON or not a valid JSON Schema.
func compileSchemas(f File, dir string) (map[string]*jsonschema.Schema, []error) {
	var schemas map[string]*jsonschema.Schema // nil when no type has one
	var p problems
	for _, typ := range slices.Sorted(maps.Keys(f.Jobs.Tasks)) {
		file := f.Jobs.Tasks[typ].Schema
		if file == "" {
			continue
		}
		if !filepath.IsAbs(file) {
			file = filepath.Join(dir, file)
		}
		schema, err := compileSchema(file)
		if err != nil {
			p.add("tasks."+typ+".schema", "%v", err)
			continue
		}
		if schemas == nil {
			schemas = map[string]*jsonschema.Schema{}
		}
		schemas[typ] = schema
	}
	return schemas, p
}

// compileSchema compiles the JSON Schema in file: 2020-12 unless its
// $schema names another draft; formats ("format": "email") are checked,
// not only noted. It may refer ($ref) to files in its own directory or below
// it, and to nothing else (see schemaFileLoader).
func compileSchema(file string) (*jsonschema.Schema, error) {
	doc, err := readSchema(file)
	if err != nil {
		return nil, err
	}
	loader, err := newSchemaFileLoader(filepath.Dir(file))
	if err != nil {
		return nil, err
	}
	defer loader.root.Close()
	c := jsonschema.NewCompiler()
	c.DefaultDraft(jsonschema.Draft2020)
	c.AssertFormat()
	c.UseLoader(loader)
	if err := c.AddResource(file, doc); err != nil {
		return nil, fmt.Errorf("%s: %s", file, oneLine(err))
	}
	schema, err := c.Compile(file)
	var load *jsonschema.LoadURLError
	switch {
	case errors.As(err, &load):
		return nil, fmt.Errorf("%s: $ref %s: %v", file, load.URL, load.Err)
	case err != nil:
		return nil, fmt.Errorf("%s is not a valid JSON Schema: %s", file, oneLine(err))
	}
	return schema, nil
}

// readSchema reads and parses a schema file of at most maxSchemaSize bytes.
func readSchema(file string) (any, error) {
	f, err := os.Open(file)
	if err != nil {
		return nil, fmt.Errorf("cannot read the schema: %w", err)
	}
	defer f.Close()
	return decodeSchema(file, f)
}

// decodeSchema parses the schema named name from r, reading at most
// maxSchemaSize bytes.
func decodeSchema(name string, r io.Reader) (any, error) {
	data, err := io.ReadAll(io.LimitReader(r, maxSchemaSize+1))
	switch {
	case err != nil:
		return nil, fmt.Errorf("cannot read the schema %s: %w", name, err)
	case len(data) > maxSchemaSize:
		return nil, fmt.Errorf("%s is larger than %d KiB; a payload's schema should be far smaller", name, maxSchemaSize>>10)
	}
	doc, err := jsonschema.UnmarshalJSON(bytes.NewReader(data))
	if err != nil {
		return nil, fmt.Errorf("%s is not JSON: %w", name, err)
	}
	return doc, nil
}

// schemaFileLoader loads the files a schema refers to, bounded as the
// schema itself is, and only those in the schema's directory or below it:
// a $ref is the schema author's to write, and must not read /etc/passwd or
// a secret beside the config. Every $ref reaches it resolved to an absolute
// URL, so one check covers "../x.json", file:// URLs and a $id that moves
// the base; opening through an os.Root covers symlinks that lead out.
type schemaFileLoader struct {
	dir  string   // the schema's directory, absolute, as the library's URLs spell it
	root *os.Root // dir, opened
}

func newSchemaFileLoader(dir string) (schemaFileLoader, error) {
	dir, err := filepath.Abs(dir)
	if err != nil {
		return schemaFileLoader{}, fmt.Errorf("cannot read the schema's directory: %w", err)
	}
	root, err := os.OpenRoot(dir)
	if err != nil {
		return schemaFileLoader{}, fmt.Errorf("cannot read the schema's directory: %w", err)
	}
	return schemaFileLoader{dir: dir, root: root}, nil
}

func (l schemaFileLoader) Load(rawURL string) (any, error) {
	rule := fmt.Sprintf("a schema may refer only to files in its own directory (%s) or below it, by a relative path: no URLs, no paths or symlinks out of it", l.dir)
	u, err := url.Parse(rawURL)
	if err != nil || u.Scheme != "file" || u.Host != "" {
		return nil, errors.New("refused: " + rule)
	}
	rel, err := filepath.Rel(l.dir, filepath.FromSlash(u.Path))
	if err != nil || !filepath.IsLocal(rel) {
		return nil, errors.New("refused: " + rule)
	}
	f, err := l.root.Open(rel)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return nil, fmt.Errorf("no such file in %s", l.dir)
	case err != nil:
		// A symlink that leads out of the directory is refused here, by
		// the os.Root: "openat x.json: path escapes from parent".
		return nil, fmt.Errorf("refused: %v; %s", err, rule)
	}
	defer f.Close()
	doc, err := decodeSchema(rel, f)
	if syntax := (*json.SyntaxError)(nil); errors.As(err, &syntax) {
		// The parser's message quotes the character it met.
		return nil, fmt.Errorf("%s is not JSON: a syntax error at byte %d", rel, syntax.Offset)
	}
	return doc, err
}

// oneLine puts the library's multi-line messages on one line, for a
// problem's line.
func oneLine(err error) string {
	return strings.Join(strings.Fields(strings.ReplaceAll(err.Error(), "\n", "; ")), " ")
}

// PayloadError is a payload that its type's schema refuses: what is wrong
// and where, as JSON Pointers into the payload ("/to", "/items/2"; "" is
// the whole payload).
type PayloadError struct {
	Type       string
	Violations []Violation // at most 10
	More       int         // violations past those
}

// Violation is one way a payload breaks its schema.
type Violation struct {
	Path    string // a JSON Pointer into the payload: "/to"
	Problem string // what the schema wanted: "got number, want string"
}

// Error says each violation with its path:
// `email:send: payload /to: got number, want string; payload: missing property 'from'`.
func (e *PayloadError) Error() string {
	var b strings.Builder
	b.WriteString(e.Type + ": ")
	for i, v := range e.Violations {
		if i > 0 {
			b.WriteString("; ")
		}
		where := "payload " + v.Path
		if v.Path == "" {
			where = "payload"
		}
		fmt.Fprintf(&b, "%s: %s", where, v.Problem)
	}
	if e.More > 0 {
		fmt.Fprintf(&b, "; and %d more", e.More)
	}
	return b.String()
}

// CheckKeys checks that a task of type typ in queue with payload has a
// key for every keyed limit it would meet (jobs.CheckKeys), as enqueue and
// its intake do before it is enqueued: a key that cannot be computed is a
// *jobs.KeyError naming the limit, the expression and the problem.
func (f File) CheckKeys(queue, typ string, payload []byte) error {
	return jobs.CheckKeys(f.Jobs, queue, typ, payload, "")
}

// CheckPayload checks a payload for task type typ before it is enqueued,
// as enqueue and its intake do: a built-in type by its own rules; a type
// named under tasks by its schema (tasks.<type>.schema), or as any JSON
// value if it has none (no payload at all is allowed then too); a type
// named nowhere is refused, naming the known types. A payload that its
// schema refuses is a *PayloadError.
func (f File) CheckPayload(typ string, payload []byte) error {
	builtin, isBuiltin := jobs.LookupType(typ)
	_, configured := f.Jobs.Tasks[typ]
	if !isBuiltin && !configured {
		return fmt.Errorf("unknown task type %q; known types are %s (a type of your own must be named under tasks: in the config)", typ, strings.Join(f.TaskTypes(), ", "))
	}
	if isBuiltin {
		if err := builtin.Validate(payload); err != nil {
			return err
		}
	}
	schema := f.schemas[typ]
	empty := len(bytes.TrimSpace(payload)) == 0
	switch {
	case empty && schema != nil && !isBuiltin:
		return fmt.Errorf("%s: payload: missing; tasks.%s.schema describes a JSON value", typ, typ)
	case empty:
		return nil
	}
	value, err := jsonschema.UnmarshalJSON(bytes.NewReader(payload))
	if err != nil {
		var syntax *json.SyntaxError
		if errors.As(err, &syntax) {
			return fmt.Errorf("%s: payload: invalid JSON at byte %d: %v", typ, syntax.Offset, err)
		}
		return fmt.Errorf("%s: payload: invalid JSON: %v", typ, err)
	}
	if schema == nil {
		return nil
	}
	err = schema.Validate(value)
	var invalid *jsonschema.ValidationError
	if !errors.As(err, &invalid) {
		return err
	}
	perr := &PayloadError{Type: typ}
	perr.add(invalid)
	return perr
}

// english prints the library's messages.
var english = message.NewPrinter(language.English)

// add adds the violations at the leaves of e's tree: the nodes above them
// only say "validation failed" (a group, a $ref).
func (e *PayloadError) add(v *jsonschema.ValidationError) {
	if len(v.Causes) > 0 {
		for _, cause := range v.Causes {
			e.add(cause)
		}
		return
	}
	if len(e.Violations) == maxViolations {
		e.More++
		return
	}
	var path strings.Builder
	for _, token := range v.InstanceLocation {
		// JSON Pointer escapes (RFC 6901): ~ as ~0, / as ~1.
		path.WriteString("/" + strings.NewReplacer("~", "~0", "/", "~1").Replace(token))
	}
	e.Violations = append(e.Violations, Violation{Path: path.String(), Problem: v.ErrorKind.LocalizedString(english)})
}

// TaskTypes lists the task types enqueue takes: the built-in ones and those
// named under tasks, sorted.
func (f File) TaskTypes() []string {
	var types []string
	for _, t := range jobs.Types() {
		types = append(types, t.Name)
	}
	for name := range f.Jobs.Tasks {
		if !slices.Contains(types, name) {
			types = append(types, name)
		}
	}
	slices.Sort(types)
	return types
}
