package config

import (
	"crypto/sha256"
	"fmt"
	"iter"
	"maps"
	"path/filepath"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode"

	"github.com/spf13/viper"
	"go.yaml.in/yaml/v3"
)

// load decodes data, the content of the file at path, into a File: the
// YAML's nodes give every key's line and the names in their own case (viper
// folds keys to lower case), viper reads the SLUICE_* variables, which win.
// See the package doc for the rules.
func load(path string, data []byte) (File, error) {
	d := decoder{file: path, env: viper.NewWithOptions(viper.EnvKeyReplacer(envReplacer{})), lines: map[string]int{}, from: map[string]string{}, vars: map[string][]string{}, bad: map[string]bool{}}
	d.env.SetEnvPrefix("SLUICE")
	d.env.AutomaticEnv()
	var doc yaml.Node
	if err := yaml.Unmarshal(data, &doc); err != nil {
		// yaml's message names the line: "yaml: line 3: did not find expected key"
		d.add("", "not valid YAML: %s", strings.TrimPrefix(err.Error(), "yaml: "))
		return File{}, &Problems{Path: path, Errs: d.errs}
	}
	var f, root = File{}, (*yaml.Node)(nil)
	if len(doc.Content) > 0 {
		root = deref(doc.Content[0])
	}
	d.decode("", root, reflect.ValueOf(&f).Elem())
	for _, name := range slices.Sorted(maps.Keys(d.vars)) {
		if keys := d.vars[name]; len(keys) > 1 && d.from[keys[0]] != "" {
			d.errs = append(d.errs, &Problem{File: path, Env: name, Msg: fmt.Sprintf("would set each of %s; rename one of them or set the key in the file", strings.Join(keys, ", "))})
		}
	}
	slices.SortStableFunc(d.errs, func(a, b error) int { return a.(*Problem).Line - b.(*Problem).Line })
	f = f.Defaults()
	schemas, errs := compileSchemas(f, filepath.Dir(path))
	for _, err := range append(f.Validate(), errs...) {
		key, msg, _ := strings.Cut(err.Error(), ": ") // every problem starts with its key
		if !d.unread(key) {
			d.add(key, "%s", msg)
		}
	}
	if len(d.errs) > 0 {
		return File{}, &Problems{Path: path, Errs: d.errs}
	}
	f.digest = sha256.Sum256(data)
	f.schemas = schemas
	return f, nil
}

// decoder is the state of one load. Keys are spelled as in config.yaml:
// queues.emails.drain.limit, redis.cluster[1].
type decoder struct {
	file  string
	env   *viper.Viper
	errs  []error
	lines map[string]int      // key -> its line in the file
	from  map[string]string   // key -> the variable that set it
	vars  map[string][]string // variable -> the keys it would set
	bad   map[string]bool     // keys that could not be decoded
}

// decode sets v, the value at key, from n (nil: not in the file) and the
// environment.
func (d *decoder) decode(key string, n *yaml.Node, v reflect.Value) {
	if n != nil && n.ShortTag() == "!!null" {
		n = nil // "idle:" with no value
	}
	switch t := v.Type(); {
	case t.Kind() == reflect.Pointer: // set only if the file or a variable gives a key
		p, set := reflect.New(t.Elem()), len(d.from)
		if d.decode(key, n, p.Elem()); n != nil || len(d.from) > set {
			v.Set(p)
		}
	case t.Kind() == reflect.Struct:
		fs, nodes := fieldsOf(t), map[string]*yaml.Node{}
		for k, val := range d.pairs(key, n, t, strings.ToLower) {
			name := strings.ToLower(k.Value)
			if d.lines[join(key, name)] = k.Line; !slices.ContainsFunc(fs, func(f field) bool { return f.name == name }) {
				d.add(join(key, k.Value), "unknown key; known keys here are %s", names(fs))
			}
			nodes[name] = val
		}
		for _, f := range fs {
			d.decode(join(key, f.name), nodes[f.name], v.FieldByIndex(f.index))
		}
	case t.Kind() == reflect.Map: // of names, in their case
		for k, val := range d.pairs(key, n, t, func(s string) string { return s }) {
			d.lines[join(key, k.Value)] = k.Line
			if v.IsNil() {
				v.Set(reflect.MakeMap(t))
			}
			entry := reflect.New(t.Elem()).Elem()
			d.decode(join(key, k.Value), val, entry)
			v.SetMapIndex(reflect.ValueOf(k.Value), entry)
		}
	case t.Kind() == reflect.Slice && t.Elem().Kind() == reflect.Struct: // gateway.limits: no variables
		if n != nil && d.shape(key, n, yaml.SequenceNode, t) {
			v.Set(reflect.MakeSlice(t, len(n.Content), len(n.Content)))
			for i, item := range n.Content {
				d.lines[fmt.Sprintf("%s[%d]", key, i)] = item.Line
				d.decode(fmt.Sprintf("%s[%d]", key, i), deref(item), v.Index(i))
			}
		}
	default:
		name := envReplacer{}.Replace(strings.ToUpper("SLUICE_" + key))
		if !strings.Contains(key, "[") { // an item of a list has no name to spell a variable with
			d.vars[name] = append(d.vars[name], key)
			if s, ok := d.env.Get(key).(string); ok {
				if d.from[key] = name; !setString(v, s) {
					d.wrong(key, t, strconv.Quote(s))
				}
				return
			}
		}
		if n != nil && !setNode(v, n) {
			d.wrong(key, t, describe(n))
		}
	}
}

// pairs yields the keys and values of n, a mapping of t's keys, those of
// mappings merged into it (<<: *anchor) included unless n sets them
// itself. A key set twice, as fold spells it, is a problem.
func (d *decoder) pairs(key string, n *yaml.Node, t reflect.Type, fold func(string) string) iter.Seq2[*yaml.Node, *yaml.Node] {
	return func(yield func(*yaml.Node, *yaml.Node) bool) {
		if n == nil || !d.shape(key, n, yaml.MappingNode, t) {
			return
		}
		own, merged := map[string]int{}, []*yaml.Node{}
		for i := 0; i+1 < len(n.Content); i += 2 {
			k, val := n.Content[i], deref(n.Content[i+1])
			if k.ShortTag() == "!!merge" {
				merged = append(merged, val)
				if val.Kind == yaml.SequenceNode {
					merged = append(merged[:len(merged)-1], val.Content...)
				}
				continue
			}
			if first, twice := own[fold(k.Value)]; twice {
				d.lines[join(key, k.Value)] = k.Line
				d.add(join(key, k.Value), "set twice; first at line %d", first)
				continue
			}
			own[fold(k.Value)] = k.Line
			if !yield(k, val) {
				return
			}
		}
		for _, m := range merged {
			for k, val := range d.pairs(key, deref(m), t, fold) {
				if _, set := own[fold(k.Value)]; !set && !yield(k, val) {
					return
				}
			}
		}
	}
}

// shape reports whether n is of kind, and if not, adds the problem.
func (d *decoder) shape(key string, n *yaml.Node, kind yaml.Kind, t reflect.Type) bool {
	if n.Kind != kind {
		d.wrong(key, t, describe(n))
	}
	return n.Kind == kind
}

// wrong adds the problem of key, whose value got cannot be a t.
func (d *decoder) wrong(key string, t reflect.Type, got string) {
	d.bad[key] = true // its zero value would only repeat the problem in validation
	d.add(key, "must be %s, got %s", want(t), got)
}

// add adds a problem of key, placed at the variable that set key or the
// nearest key above it, else at the line of the nearest key in the file.
func (d *decoder) add(key, format string, args ...any) {
	p := &Problem{File: d.file, Path: key, Msg: fmt.Sprintf(format, args...)}
	for k := range keyAndParents(key) {
		if p.Env, p.Line = d.from[k], d.lines[k]; p.Env != "" || p.Line != 0 {
			break
		}
	}
	if p.Env != "" {
		p.Line = 0
	}
	d.errs = append(d.errs, p)
}

// unread reports whether key, or a key above it, could not be decoded.
func (d *decoder) unread(key string) bool {
	for k := range keyAndParents(key) {
		if d.bad[k] {
			return true
		}
	}
	return false
}

// setNode sets v from n, a value in the file. Strings, quoted or not, are
// read as a variable's would be ("42", "1s", "a, b"); other scalars as YAML
// resolves them, except that a duration needs its unit and a whole number
// must be one.
func setNode(v reflect.Value, n *yaml.Node) bool {
	switch tag := n.ShortTag(); {
	case v.Kind() == reflect.Slice && n.Kind == yaml.SequenceNode:
		items := make([]string, len(n.Content))
		for i, item := range n.Content {
			if item = deref(item); item.Kind != yaml.ScalarNode {
				return false
			}
			items[i] = item.Value
		}
		v.Set(reflect.ValueOf(items))
		return true
	case n.Kind != yaml.ScalarNode:
		return false
	case v.Kind() == reflect.String || tag == "!!str":
		return setString(v, n.Value)
	case v.Kind() == reflect.Slice || v.Type() == durationType || tag == "!!float":
		return false
	}
	return n.Decode(v.Addr().Interface()) == nil
}

var durationType = reflect.TypeFor[time.Duration]()

// setString sets v from s, a variable's value or a string in the file; a
// list is comma-separated.
func setString(v reflect.Value, s string) bool {
	var err error
	switch {
	case v.Type() == durationType:
		var d time.Duration
		d, err = time.ParseDuration(s)
		v.SetInt(int64(d))
	case v.Kind() == reflect.Int:
		var i int
		i, err = strconv.Atoi(s)
		v.SetInt(int64(i))
	case v.Kind() == reflect.Bool:
		var b bool
		b, err = strconv.ParseBool(s)
		v.SetBool(b)
	case v.Kind() == reflect.Slice:
		var items []string
		for item := range strings.SplitSeq(s, ",") {
			if item = strings.TrimSpace(item); item != "" {
				items = append(items, item)
			}
		}
		v.Set(reflect.ValueOf(items))
	default:
		v.SetString(s)
	}
	return err == nil
}

// want says what a value of type t must be.
func want(t reflect.Type) string {
	switch {
	case t == durationType:
		return "a duration with a unit, like 1s, 500ms or 5m"
	case t.Kind() == reflect.Int:
		return "a whole number"
	case t.Kind() == reflect.Bool:
		return "true or false"
	case t.Kind() == reflect.String:
		return "a string"
	case t.Kind() == reflect.Slice:
		return "a list, like [a, b]"
	case t.Kind() == reflect.Map:
		return "a mapping of names"
	}
	return "a mapping with keys " + names(fieldsOf(t))
}

// describe shows a value of the file in a problem.
func describe(n *yaml.Node) string {
	switch n.Kind {
	case yaml.MappingNode:
		return "a mapping"
	case yaml.SequenceNode:
		return "a list"
	}
	return strconv.Quote(n.Value)
}

// deref is the node an alias (*anchor) stands for.
func deref(n *yaml.Node) *yaml.Node {
	for n != nil && n.Kind == yaml.AliasNode {
		n = n.Alias
	}
	return n
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

// keyAndParents yields queues.emails.drain, queues.emails, queues.
func keyAndParents(key string) iter.Seq[string] {
	return func(yield func(string) bool) {
		for k := key; k != ""; k = k[:max(strings.LastIndexAny(k, ".["), 0)] {
			if !yield(k) {
				return
			}
		}
	}
}

func join(key, name string) string {
	if key == "" {
		return name
	}
	return key + "." + name
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
