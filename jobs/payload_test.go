package jobs

import (
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"testing"

	"github.com/google/cel-go/cel"
	"github.com/google/cel-go/common/types"
)

// TestPayloadReadAsDecoded: key expressions over a payload read where they
// look (payload.go) give what they give over the payload decoded whole by
// encoding/json, the way it was read before: the same value, or an error
// where that gives one. Each expression runs on each payload.
func TestPayloadReadAsDecoded(t *testing.T) {
	payloads := []string{
		`{"k": "v1", "n": 42, "f": 1.5, "b": true, "z": null}`,
		`{"headers": {"X-Tenant": "acme", "X-Dest": "d7"}, "url": "https://API.example.com:8443/x"}`,
		`{"k": "first", "k": "last"}`, // encoding/json keeps the last
		`{"a": [1, "two", {"c": "three"}, [4]], "o": {"p": {"q": "deep"}}}`,
		`{"k": "caf\u00e9 \"quoted\" \\ done", "e": {}, "l": []}`,
		"{\"k\": \"bad \xff utf-8\"}",
		"{\"\xff\": \"a key of bad utf-8\"}",
		`["x", "y"]`,
		`"just a string"`,
		`7`,
		`null`,
		` { "k" : "spaced" } `,
		`{"a": [1, 2], "b": [1, 2], "o": {"x": 1, "y": [2]}, "p": {"y": [2], "x": 1}}`,
	}
	exprs := []string{
		`payload.k`,
		`payload["\uFFFD"]`,
		`payload.n`,
		`payload.f`,
		`payload.b`,
		`payload.z`,
		`payload.headers["X-Tenant"]`,
		`host(payload.url)`,
		`payload.a[0]`,
		`payload.a[1]`,
		`payload.a[2].c`,
		`payload.a[3][0]`,
		`payload.a[7]`,
		`payload.a[-1]`,
		`payload.o.p.q`,
		`payload.missing`,
		`has(payload.k)`,
		`has(payload.o.p)`,
		`has(payload.missing)`,
		`"k" in payload`,
		`1 in payload.a`,
		`size(payload)`,
		`size(payload.a)`,
		`size(payload.e)`,
		`size(payload.l)`,
		`payload.a == payload.b`,
		`payload.o == payload.p`,
		`payload.o == {"x": 1.0, "y": [2.0]}`,
		`payload.a + ["z"]`,
		`payload.e == {}`,
		`payload[0]`,
		`payload == "just a string"`,
		`payload + 1.0`,
		`type(payload)`,
		`type(payload.a)`,
		`payload.headers.all(h, h.startsWith("X-"))`,
		`payload.a.exists(x, x == "two")`,
		`payload.k.upperAscii()`,
		`string(payload.n)`,
		`payload.headers["X-Tenant"] + "/" + payload.headers["X-Dest"]`,
		// Reads again, and more reads than maxWalks (see jsonWhole.read).
		`[payload.k, payload.k, payload.n, payload.k, size(payload), payload.k]`,
		`[payload.a[0], payload.a[0], payload.a[1], size(payload.a), payload.a[-1]]`,
		`[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19].filter(i, i < size(payload.a) && payload.a[i] == "two")`,
		`payload`,
	}
	env, err := keyEnv()
	if err != nil {
		t.Fatal(err)
	}
	values := 0 // outcomes that are values, not errors
	for _, source := range exprs {
		ast, iss := env.Compile(source)
		if iss.Err() != nil {
			t.Fatalf("%s: %v", source, iss.Err())
		}
		prg, err := env.Program(ast, cel.CostLimit(maxKeyCost))
		if err != nil {
			t.Fatal(err)
		}
		for _, payload := range payloads {
			var decoded any
			if err := json.Unmarshal([]byte(payload), &decoded); err != nil {
				t.Fatalf("%s: %v", payload, err)
			}
			want := evalOutcome(prg.Eval(map[string]any{"payload": decoded, "type": "t", "queue": "q"}))
			vars := newTaskVars("q", "id", "t", []byte(payload))
			if err := vars.check(); err != nil {
				t.Fatalf("%s: %v", payload, err)
			}
			if got := evalOutcome(prg.Eval(vars)); got != want {
				t.Errorf("%s on %s: %s; decoded whole it gives %s", source, payload, got, want)
			}
			if want != "an error" {
				values++
			}
		}
	}
	// Most pairs fail (an expression for another payload's shape): the
	// comparison is worth something only where values come out.
	t.Logf("%d of %d pairs give a value", values, len(exprs)*len(payloads))
	if values < len(exprs) {
		t.Errorf("only %d of %d pairs give a value, want at least %d", values, len(exprs)*len(payloads), len(exprs))
	}
}

// evalOutcome says what an evaluation gave: a value and its type, or that it
// failed (the message may differ: a missing key reads the same either way,
// but the test asks only that both fail).
func evalOutcome(out interface{ Value() any }, _ any, err error) string {
	if err != nil {
		return "an error"
	}
	return fmt.Sprintf("%T %v", out.Value(), out.Value())
}

// TestPayloadNotJSON: a payload that is not JSON, or nested deeper than
// encoding/json reads, is an error for every expression (the task takes
// the limit's default key), as when it was decoded whole.
func TestPayloadNotJSON(t *testing.T) {
	deep := make([]byte, 0, 20002)
	for range 10001 {
		deep = append(deep, '[')
	}
	for range 10001 {
		deep = append(deep, ']')
	}
	for _, payload := range [][]byte{[]byte(`{"k": `), []byte(`{"k": "v"} x`), []byte("\x00"), deep} {
		if err := newTaskVars("q", "id", "t", payload).check(); err == nil {
			t.Errorf("%.40q...: no error, want one: it is not JSON encoding/json reads", payload)
		}
	}
}

// TestPayloadReadLazily: a key expression that selects fields decodes
// nothing whole: not the payload, not the object it looks into.
func TestPayloadReadLazily(t *testing.T) {
	k, err := compileKey(`payload.headers["X-Tenant"] + "/" + host(payload.url)`)
	if err != nil {
		t.Fatal(err)
	}
	vars := newTaskVars("q", "id", "t", []byte(`{"url": "https://a.example/x", "headers": {"X-Tenant": "acme", "Big": "`+strings.Repeat("x", 1000)+`"}, "body": [1, 2, 3]}`))
	if got, err := k.eval(vars); err != nil || got != "acme/a.example" {
		t.Fatalf("eval = %q, %v; want acme/a.example", got, err)
	}
	if payload := vars.payload.(*jsonObject); payload.decoded != nil {
		t.Errorf("the payload was decoded whole for a field: %v", payload.decoded)
	}
}

// TestPayloadReadsBounded: an expression that reads a field or element
// again and again (in a comprehension) walks the raw JSON for it once, and
// one that reads many walks at most maxWalks times, then reads the value
// decoded. Walking for every read made one task's key take 38s on a 1 MB
// payload (payload.l.exists(x, ... payload.l[499999] ...)).
func TestPayloadReadsBounded(t *testing.T) {
	var raw, first40 strings.Builder
	raw.WriteString(`{"l": [0`)
	for i := 1; i < 300; i++ {
		fmt.Fprintf(&raw, ",%d", i)
	}
	raw.WriteString(`], "k": "v"}`)
	indices := make([]string, 40)
	for i := range indices {
		indices[i] = strconv.Itoa(i)
	}
	first40.WriteString(strings.Join(indices, ","))
	for _, tc := range []struct {
		source string
		want   string
		// walks of the payload, and of its array l (-1: l not read again)
		payloadWalks, arrayWalks int
		arrayDecoded             bool
	}{
		{`payload.l.exists(x, x == 2000.0 || payload.k == "z") ? "found" : "none"`, "none", 2, -1, true},
		{`payload.l.exists(x, x == 2000.0 || payload.l[299] == 2.0 || size(payload.l) == 2) ? "found" : "none"`, "none", 1, 0, true},
		{`[` + first40.String() + `].map(i, string(int(payload.l[i]))).join(",")`, first40.String(), 1, maxWalks, true},
		{`string(int(payload.l[299])) + payload.k`, "299v", 2, -1, false},
	} {
		k, err := compileKey(tc.source)
		if err != nil {
			t.Fatal(err)
		}
		vars := newTaskVars("q", "id", "t", []byte(raw.String()))
		got, err := k.eval(vars)
		if err != nil || got != tc.want {
			t.Errorf("%s = %.50q, %v; want %.50q", tc.source, got, err, tc.want)
			continue
		}
		payload := vars.payload.(*jsonObject)
		if payload.walks != tc.payloadWalks {
			t.Errorf("%s: the payload was walked %d times, want %d", tc.source, payload.walks, tc.payloadWalks)
		}
		if tc.arrayWalks < 0 {
			continue
		}
		l, _ := payload.Find(types.String("l")) // the value the last read gave
		if a := l.(*jsonArray); a.walks != tc.arrayWalks || (a.decoded != nil) != tc.arrayDecoded {
			t.Errorf("%s: l was walked %d times, decoded %v; want %d, %v", tc.source, a.walks, a.decoded != nil, tc.arrayWalks, tc.arrayDecoded)
		}
	}
}
