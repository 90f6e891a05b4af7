package config

import (
	"reflect"
	"slices"
	"strings"
	"unicode"
)

// A key is spelled as in config.yaml: queues.emails.drain.limit,
// redis.cluster[1]; each part is its struct field's name in snake_case, or
// a name (of a queue, quota or task type) as written.

func join(key, name string) string {
	if key == "" {
		return name
	}
	return key + "." + name
}

// parents lists key and the keys above it: queues.emails.drain,
// queues.emails, queues.
func parents(key string) []string {
	var keys []string
	for k := key; k != ""; k = k[:max(strings.LastIndexAny(k, ".["), 0)] {
		keys = append(keys, k)
	}
	return keys
}

type field struct {
	name  string
	index []int
}

// fieldsOf lists the keys of struct type t in declaration order; a field
// tagged `config:",squash"` contributes its fields instead of itself.
func fieldsOf(t reflect.Type) []field {
	var fs []field
	for f := range t.Fields() {
		if !f.IsExported() {
			continue // not a key: state of the package's own
		}
		if f.Tag.Get("config") == ",squash" {
			for _, sub := range fieldsOf(f.Type) {
				fs = append(fs, field{sub.name, append(slices.Clone(f.Index), sub.index...)})
			}
			continue
		}
		fs = append(fs, field{snakeCase(f.Name), f.Index})
	}
	return fs
}

func names(fs []field) string {
	s := make([]string, len(fs))
	for i, f := range fs {
		s[i] = f.name
	}
	return strings.Join(s, ", ")
}

// snakeCase spells a Go field name as a config key: MetricsAddr is
// metrics_addr, HTTP is http, OnRedisError is on_redis_error.
func snakeCase(s string) string {
	var b strings.Builder
	r := []rune(s)
	for i, c := range r {
		if i > 0 && unicode.IsUpper(c) && (unicode.IsLower(r[i-1]) || i+1 < len(r) && unicode.IsLower(r[i+1])) {
			b.WriteByte('_')
		}
		b.WriteRune(unicode.ToLower(c))
	}
	return b.String()
}

// want says what a value of type t must be.
func want(t reflect.Type) string {
	switch t.Kind() {
	case reflect.Int64: // time.Duration, the only one of its kind
		return "a duration with a unit, like 1s, 500ms or 5m"
	case reflect.Int:
		return "a whole number"
	case reflect.Bool:
		return "true or false"
	case reflect.String:
		return "a string"
	case reflect.Slice:
		return "a list, like [a, b]"
	case reflect.Map:
		return "a mapping of names"
	}
	return "a mapping with keys " + names(fieldsOf(t))
}

// envReplacer spells a key, as viper passes it (SLUICE_QUEUES.EMAILS.PRIORITY),
// as its variable: every character other than an ASCII letter or digit
// becomes "_".
type envReplacer struct{}

func (envReplacer) Replace(s string) string {
	return strings.Map(func(r rune) rune {
		if r < unicode.MaxASCII && (unicode.IsLetter(r) || unicode.IsDigit(r)) {
			return r
		}
		return '_'
	}, s)
}
