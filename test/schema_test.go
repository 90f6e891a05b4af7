package test

import (
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/sluicehq/sluice/internal/redistest"
)

// emailSchema wants {"to": a string}.
const emailSchema = `{
  "$schema": "https://json-schema.org/draft/2020-12/schema",
  "type": "object",
  "properties": {"to": {"type": "string"}, "subject": {"type": "string"}},
  "required": ["to"],
  "additionalProperties": false
}`

// TestEnqueueSchema: a payload that breaks its type's schema
// (tasks.email:send.schema) is refused by enqueue, enqueue --file and
// enqueue serve before anything is written, naming the JSON path and what
// was expected (and the line, for a file); a good one lands; a type under
// tasks without a schema takes any JSON; a type named nowhere is refused,
// listing the known ones.
func TestEnqueueSchema(t *testing.T) {
	t.Parallel()
	addr := redistest.Addr(t)
	queue := redistest.Queue(t, "emails")
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "email.schema.json"), []byte(emailSchema), 0o644); err != nil {
		t.Fatal(err)
	}
	config := filepath.Join(dir, "config.yaml")
	if err := os.WriteFile(config, fmt.Appendf(nil, `
redis: {addr: 127.0.0.1:1}
queues:
  %s: {}
tasks:
  email:send: {schema: email.schema.json}
  any:thing: {}
`, queue), 0o644); err != nil {
		t.Fatal(err)
	}
	enqueue := func(args ...string) enqueueRun {
		return runEnqueue(t, addr, nil, append([]string{"--config", config, "--queue", queue}, args...)...)
	}

	bad := enqueue("email:send", `{"to": 5}`)
	if bad.code != 2 || !strings.Contains(bad.stderr, "email:send: payload /to: got number, want string") {
		t.Errorf("a payload against its schema: %v\nwant exit 2 naming /to and the string it wants", bad)
	}
	file := writeLines(t, 3, func(i int) string {
		if i == 2 {
			return `{"type": "email:send", "payload": {"to": 5}}`
		}
		return `{"type": "email:send", "payload": {"to": "ann@example.com"}}`
	})
	badFile := enqueue("--file", file)
	if badFile.code != 2 || !strings.Contains(badFile.stderr, "line 2: email:send: payload /to: got number, want string") {
		t.Errorf("a file with a payload against its schema: %v\nwant exit 2 naming line 2, /to and what it wants", badFile)
	}
	unknown := enqueue("email:sned", `{"to": "ann@example.com"}`)
	if unknown.code != 2 || !strings.Contains(unknown.stderr, "known types are any:thing, demo:noop, demo:sleep, email:send, http:request") {
		t.Errorf("a type named nowhere: %v\nwant exit 2 listing the known types", unknown)
	}
	if n := queueSize(t, addr, queue); n != 0 {
		t.Fatalf("%d tasks in Redis after refused input, want 0", n)
	}

	for _, args := range [][]string{
		{"email:send", `{"to": "ann@example.com", "subject": "hi"}`},
		{"any:thing", `[1, "two", {"three": null}]`},
		{"any:thing"},
		{"--file", writeLines(t, 2, func(int) string { return `{"type": "email:send", "payload": {"to": "bob@example.com"}}` })},
	} {
		if r := enqueue(args...); r.code != 0 {
			t.Errorf("enqueue %q: %v\nwant exit 0", args, r)
		}
	}
	if n := queueSize(t, addr, queue); n != 5 {
		t.Errorf("%d tasks in Redis after 5 good ones, want 5", n)
	}

	// The intake: its types named in gateway.types, the schema by its
	// absolute path (startIntake writes the config elsewhere).
	intakeQueue := redistest.Queue(t, "intake")
	s := startIntake(t, fmt.Sprintf("  types: [email:send]\ntasks:\n  email:send: {schema: %s}\n", writeFile(t, "email.schema.json", emailSchema)), intakeQueue)
	status, body := s.send(t, fmt.Sprintf(`{"type": "email:send", "queue": %q, "payload": {"to": 5}}`, intakeQueue), nil)
	if status != http.StatusBadRequest || !strings.Contains(body, "payload /to: got number, want string") || !strings.Contains(body, `"path":"/to"`) {
		t.Errorf("the intake, a payload against its schema: %d %s, want 400 with the path /to", status, body)
	}
	if n := queueSize(t, addr, intakeQueue); n != 0 {
		t.Errorf("%d tasks in Redis after the intake refused the only one, want 0", n)
	}
	if status, body := s.send(t, fmt.Sprintf(`{"type": "email:send", "queue": %q, "payload": {"to": "ann@example.com"}}`, intakeQueue), nil); status != http.StatusAccepted {
		t.Errorf("the intake, a good payload: %d %s, want 202", status, body)
	}
	if n := queueSize(t, addr, intakeQueue); n != 1 {
		t.Errorf("%d tasks in Redis after the intake took one, want 1", n)
	}
}

// TestSchemaFileProblems: a schema file that is missing or is not a valid
// schema, or that refers to a file out of its directory (19.12: the file was
// read, and its first byte told in the error), stops enqueue, enqueue serve
// and the worker at start with exit code 2, naming tasks.<type>.schema and
// the problem.
func TestSchemaFileProblems(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		desc, schema, want string
	}{
		{desc: "missing", want: "tasks.email:send.schema: cannot read the schema: open "},
		{desc: "not a schema", schema: `{"type": "strin"}`, want: "tasks.email:send.schema: "},
		{desc: "not JSON", schema: `{"type": `, want: "is not JSON"},
		{desc: "a $ref out of its directory", schema: `{"$ref": "file:///etc/passwd"}`,
			want: "$ref file:///etc/passwd: refused: a schema may refer only to files in its own directory"},
	} {
		dir := t.TempDir()
		if tt.schema != "" {
			if err := os.WriteFile(filepath.Join(dir, "email.json"), []byte(tt.schema), 0o644); err != nil {
				t.Fatal(err)
			}
		}
		config := filepath.Join(dir, "config.yaml")
		if err := os.WriteFile(config, []byte("redis: {addr: 127.0.0.1:1}\ntasks:\n  email:send: {schema: email.json}\n"), 0o644); err != nil {
			t.Fatal(err)
		}
		for _, args := range [][]string{
			{"enqueue", "--config", config, "demo:noop"},
			{"enqueue", "serve", "--config", config},
			{"worker", "--config", config},
		} {
			out, err := exec.Command(filepath.Join(bin, args[0]), args[1:]...).CombinedOutput()
			exit, _ := err.(*exec.ExitError)
			if exit == nil || exit.ExitCode() != 2 || !strings.Contains(string(out), tt.want) {
				t.Errorf("%s: %q: %v\n%s\nwant exit 2 saying %q", tt.desc, args, err, out, tt.want)
			}
			if strings.Contains(string(out), "invalid character") && tt.desc != "not JSON" {
				t.Errorf("%s: %q:\n%s\nwant nothing said of the content of a file it may not read", tt.desc, args, out)
			}
			if tt.desc == "not a schema" && !strings.Contains(string(out), "not a valid JSON Schema") {
				t.Errorf("%s: %q:\n%s\nwant it to say it is not a valid JSON Schema", tt.desc, args, out)
			}
		}
	}
}
