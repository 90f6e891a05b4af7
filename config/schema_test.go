package config

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

const emailSchema = `{
  "$schema": "https://json-schema.org/draft/2020-12/schema",
  "type": "object",
  "properties": {
    "to": {"type": "string", "format": "email"},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 20}
  },
  "required": ["to"],
  "additionalProperties": false
}`

// writeFiles writes name -> content into a new directory and returns it.
func writeFiles(t *testing.T, files map[string]string) string {
	t.Helper()
	dir := t.TempDir()
	for name, content := range files {
		path := filepath.Join(dir, name)
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

func TestCheckPayload(t *testing.T) {
	dir := writeFiles(t, map[string]string{
		"config.yaml": `
redis: {addr: 127.0.0.1:6379}
tasks:
  email:send: {schema: schemas/email.json}
  any:thing: {}
  demo:sleep: {schema: schemas/sleep.json}
`,
		"schemas/email.json": emailSchema,
		"schemas/sleep.json": `{"type": "object", "properties": {"ms": {"maximum": 100}}}`,
	})
	f, err := Load(filepath.Join(dir, "config.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	for _, tt := range []struct {
		desc, typ, payload string
		want               []string // each in the error; none: no error
		wantPaths          []string // the PayloadError's paths, if one
	}{
		{desc: "good", typ: "email:send", payload: `{"to": "ann@example.com", "tags": ["a"]}`},
		{desc: "wrong type", typ: "email:send", payload: `{"to": 5}`,
			want: []string{"email:send: payload /to: got number, want string"}, wantPaths: []string{"/to"}},
		{desc: "missing property", typ: "email:send", payload: `{}`,
			want: []string{"email:send: payload: missing property 'to'"}, wantPaths: []string{""}},
		{desc: "format checked", typ: "email:send", payload: `{"to": "ann"}`,
			want: []string{"payload /to: 'ann' is not valid email"}, wantPaths: []string{"/to"}},
		{desc: "every violation, each with its path", typ: "email:send", payload: `{"to": "a@b.c", "tags": [1, "x", 2], "cc": 1}`,
			want:      []string{"payload /tags/0: got number, want string", "payload /tags/2: got number", "additional properties 'cc' not allowed"},
			wantPaths: []string{"/tags/0", "/tags/2", ""}},
		{desc: "no payload for a type with a schema", typ: "email:send", payload: ``,
			want: []string{"email:send: payload: missing", "tasks.email:send.schema"}},
		{desc: "not JSON", typ: "email:send", payload: `{"to": "a@b.c"`, want: []string{"email:send: payload: invalid JSON"}},
		{desc: "no schema: any JSON value", typ: "any:thing", payload: `[1, "two", {"three": null}]`},
		{desc: "no schema: no payload", typ: "any:thing", payload: ``},
		{desc: "no schema: still JSON", typ: "any:thing", payload: `[1,`, want: []string{"any:thing: payload: invalid JSON"}},
		{desc: "unknown type", typ: "email:sned", payload: `{}`,
			want: []string{`unknown task type "email:sned"`, "any:thing, demo:noop, demo:sleep, email:send, http:request"}},
		{desc: "built-in keeps its checks", typ: "demo:sleep", payload: `{"ms": "5"}`, want: []string{`demo:sleep: payload: field "ms": want an integer`}},
		{desc: "built-in with a schema: both", typ: "demo:sleep", payload: `{"ms": 500}`, want: []string{"demo:sleep: payload /ms: maximum: got 500, want 100"}},
		{desc: "built-in without a schema", typ: "demo:noop", payload: ``},
	} {
		err := f.CheckPayload(tt.typ, []byte(tt.payload))
		if len(tt.want) == 0 {
			if err != nil {
				t.Errorf("%s: CheckPayload(%s, %s) = %v, want nil", tt.desc, tt.typ, tt.payload, err)
			}
			continue
		}
		for _, want := range tt.want {
			if err == nil || !strings.Contains(err.Error(), want) {
				t.Errorf("%s: CheckPayload(%s, %s) = %v, want an error with %q", tt.desc, tt.typ, tt.payload, err, want)
			}
		}
		var perr *PayloadError
		if len(tt.wantPaths) > 0 {
			if !errors.As(err, &perr) {
				t.Errorf("%s: %v is not a *PayloadError", tt.desc, err)
				continue
			}
			var paths []string
			for _, v := range perr.Violations {
				paths = append(paths, v.Path)
			}
			if strings.Join(paths, ",") != strings.Join(tt.wantPaths, ",") {
				t.Errorf("%s: violations at %q, want %q", tt.desc, paths, tt.wantPaths)
			}
		}
	}
}

// TestSchemaProblems: a schema file that cannot be used is a problem of
// Load naming tasks.<type>.schema and what is wrong, with every other
// problem of the file.
func TestSchemaProblems(t *testing.T) {
	for _, tt := range []struct {
		desc   string
		schema string // "" for no file
		want   string
	}{
		{desc: "missing", want: "cannot read the schema"},
		{desc: "not JSON", schema: `{"type": "object",}`, want: "is not JSON"},
		{desc: "not a schema", schema: `{"type": "strin"}`, want: "is not a valid JSON Schema"},
		{desc: "a schema of the wrong shape", schema: `{"properties": []}`, want: "is not a valid JSON Schema"},
		{desc: "too large", schema: `{"description": "` + strings.Repeat("x", maxSchemaSize) + `"}`, want: "is larger than 1024 KiB"},
		{desc: "a reference to a URL", schema: `{"$ref": "https://example.com/schema.json"}`, want: "$ref https://example.com/schema.json: refused: a schema may refer only to files in its own directory"},
		{desc: "a reference to a missing file", schema: `{"$ref": "other.json"}`, want: "other.json"},
	} {
		files := map[string]string{"config.yaml": `
redis: {addr: 127.0.0.1:6379}
worker: {concurrency: -1}
tasks:
  email:send: {schema: email.json}
`}
		if tt.schema != "" {
			files["email.json"] = tt.schema
		}
		_, err := Load(filepath.Join(writeFiles(t, files), "config.yaml"))
		var p *Problems
		if !errors.As(err, &p) || len(p.Errs) != 2 {
			t.Errorf("%s: Load = %v, want 2 problems", tt.desc, err)
			continue
		}
		if got := p.Errs[1].Error(); !strings.Contains(got, "config.yaml:5: tasks.email:send.schema: ") || !strings.Contains(got, tt.want) || strings.Contains(got, "\n") {
			t.Errorf("%s: problem %q, want one line naming tasks.email:send.schema and %q", tt.desc, got, tt.want)
		}
	}
}

// TestSchemaReferences: a schema may refer to another file beside it.
func TestSchemaReferences(t *testing.T) {
	dir := writeFiles(t, map[string]string{
		"config.yaml":          "redis: {addr: 127.0.0.1:6379}\ntasks:\n  email:send: {schema: schemas/email.json}\n",
		"schemas/email.json":   `{"type": "object", "properties": {"to": {"$ref": "address.json"}}}`,
		"schemas/address.json": `{"type": "string", "minLength": 3}`,
	})
	f, err := Load(filepath.Join(dir, "config.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	if err := f.CheckPayload("email:send", []byte(`{"to": "ab"}`)); err == nil || !strings.Contains(err.Error(), "payload /to: minLength") {
		t.Errorf("CheckPayload through a $ref = %v, want the referred file's minLength at /to", err)
	}
}

// TestSchemaReferencesStayBeside (19.12): a $ref reads only files in the
// schema's own directory or below it. A path out of it, a file:// URL, a
// $id that moves the base out, and a symlink that leads out (a file or a
// directory) are each a problem naming the ref and the rule, and say nothing
// of what the file outside holds; files below the schema's directory, and
// symlinks that stay in it, are read.
func TestSchemaReferencesStayBeside(t *testing.T) {
	const secret = `{"description": "s3cret", "type": "string"}`
	for _, tt := range []struct {
		desc   string
		schema string // DIR stands for the test's directory, absolute
		ref    string // what the problem names
	}{
		{desc: "a path out of the directory", schema: `{"$ref": "../outside/secret.json"}`, ref: "/outside/secret.json"},
		{desc: "a file:// URL out of it", schema: `{"$ref": "file://DIR/outside/secret.json"}`, ref: "/outside/secret.json"},
		{desc: "a file:// URL to a file that is not JSON", schema: `{"$ref": "file://DIR/outside/passwd"}`, ref: "/outside/passwd"},
		{desc: "a $id that moves the base out", schema: `{"$id": "file://DIR/outside/", "$ref": "secret.json"}`, ref: "/outside/secret.json"},
		{desc: "a symlink to a file out of it", schema: `{"$ref": "linked.json"}`, ref: "/schemas/linked.json"},
		{desc: "a path through a symlinked directory", schema: `{"$ref": "linked-dir/secret.json"}`, ref: "/schemas/linked-dir/secret.json"},
		{desc: "a URL with a host", schema: `{"$ref": "file://elsewhereDIR/schemas/ok.json"}`, ref: "file://elsewhere"},
	} {
		dir := writeFiles(t, map[string]string{
			"config.yaml":         "redis: {addr: 127.0.0.1:6379}\ntasks:\n  email:send: {schema: schemas/email.json}\n",
			"schemas/ok.json":     `{"type": "string"}`,
			"outside/secret.json": secret,
			"outside/passwd":      "root:x:0:0:root:/root:/bin/bash\n",
		})
		for link, target := range map[string]string{"schemas/linked.json": "../outside/secret.json", "schemas/linked-dir": "../outside"} {
			if err := os.Symlink(target, filepath.Join(dir, link)); err != nil {
				t.Fatal(err)
			}
		}
		if err := os.WriteFile(filepath.Join(dir, "schemas/email.json"), []byte(strings.ReplaceAll(tt.schema, "DIR", dir)), 0o644); err != nil {
			t.Fatal(err)
		}
		_, err := Load(filepath.Join(dir, "config.yaml"))
		if err == nil {
			t.Errorf("%s: Load read the file out of the schema's directory, want a problem", tt.desc)
			continue
		}
		got := err.Error()
		if !strings.Contains(got, "tasks.email:send.schema") || !strings.Contains(got, tt.ref) ||
			!strings.Contains(got, "$ref file://") ||
			!strings.Contains(got, ": refused: ") ||
			!strings.Contains(got, "a schema may refer only to files in its own directory") {
			t.Errorf("%s: Load = %q, want a problem naming tasks.email:send.schema, the ref %s and the rule", tt.desc, got, tt.ref)
		}
		for _, leak := range []string{"s3cret", "invalid character", "'r'", "root"} {
			if strings.Contains(got, leak) {
				t.Errorf("%s: Load = %q, which tells of the file's content (%q)", tt.desc, got, leak)
			}
		}
	}

	// A file in the directory that is not JSON (a config holding a
	// password, say) is named with where it breaks, not what it holds.
	dir := writeFiles(t, map[string]string{
		"config.yaml": "redis: {addr: 127.0.0.1:6379, password: hunter2}\ntasks:\n  email:send: {schema: email.json}\n",
		"email.json":  `{"$ref": "config.yaml"}`,
	})
	_, err := Load(filepath.Join(dir, "config.yaml"))
	if err == nil || !strings.Contains(err.Error(), "config.yaml is not JSON: a syntax error at byte 1") || strings.Contains(err.Error(), "'r'") {
		t.Errorf("a $ref to a file beside it that is not JSON: Load = %v, want it named with the byte where it breaks, and no character of it", err)
	}

	dir = writeFiles(t, map[string]string{
		"config.yaml":               "redis: {addr: 127.0.0.1:6379}\ntasks:\n  email:send: {schema: schemas/email.json}\n",
		"schemas/email.json":        `{"type": "object", "properties": {"to": {"$ref": "defs/address.json"}, "cc": {"$ref": "alias.json"}}}`,
		"schemas/defs/address.json": `{"type": "string", "minLength": 3}`,
	})
	if err := os.Symlink("defs/address.json", filepath.Join(dir, "schemas/alias.json")); err != nil {
		t.Fatal(err)
	}
	f, err := Load(filepath.Join(dir, "config.yaml"))
	if err != nil {
		t.Fatalf("a file below the schema's directory and a symlink that stays in it: %v", err)
	}
	for _, field := range []string{"to", "cc"} {
		if err := f.CheckPayload("email:send", []byte(`{"`+field+`": "ab"}`)); err == nil || !strings.Contains(err.Error(), "payload /"+field+": minLength") {
			t.Errorf("CheckPayload through the $ref of %s = %v, want defs/address.json's minLength", field, err)
		}
	}
}
