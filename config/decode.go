package config

import (
	"crypto/sha256"
	"errors"
	"fmt"
	"maps"
	"path/filepath"
	"reflect"
	"slices"
	"strconv"
	"strings"

	"github.com/spf13/viper"
	"go.yaml.in/yaml/v3"

	"github.com/sluicehq/sluice/jobs"
)

// load decodes data, the content of the file at path, into a File and
// validates it. The YAML's nodes give each key's line and the names in their
// own case (viper would fold them to lower case); viper reads the SLUICE_*
// variables, which win. See the package doc for the rules.
func load(path string, data []byte) (File, error) {
	env := viper.NewWithOptions(viper.EnvKeyReplacer(envReplacer{}))
	env.SetEnvPrefix("SLUICE")
	env.AutomaticEnv()
	d := &decoder{file: path, env: env, lines: map[string]int{}, from: map[string]string{}, vars: map[string][]string{}, bad: map[string]bool{}}
	var doc yaml.Node
	if err := yaml.Unmarshal(data, &doc); err != nil {
		d.add("", "not valid YAML: %s", strings.TrimPrefix(err.Error(), "yaml: ")) // "line 3: did not find expected key"
		return File{}, &Problems{Path: path, Errs: d.errs}
	}
	var f File
	d.decode("", deref(&doc), reflect.ValueOf(&f).Elem())
	for _, name := range slices.Sorted(maps.Keys(d.vars)) {
		if keys := d.vars[name]; len(keys) > 1 && d.from[keys[0]] != "" {
			d.errs = append(d.errs, &Problem{File: path, Env: name, Msg: "would set each of " + strings.Join(keys, ", ") + "; rename one of them or set the key in the file"})
		}
	}
	slices.SortStableFunc(d.errs, func(a, b error) int { return a.(*Problem).Line - b.(*Problem).Line })
	f = f.Defaults()
	schemas, errs := compileSchemas(f, filepath.Dir(path))
	for _, err := range append(f.Validate(), errs...) {
		p := &jobs.ConfigProblem{Problem: err.Error()} // one of no key is the file's
		if errors.As(err, &p); !slices.ContainsFunc(parents(p.Key), func(k string) bool { return d.bad[k] }) {
			d.add(p.Key, "%s", p.Problem) // not a zero value that repeats a problem found
		}
	}
	if len(d.errs) > 0 {
		return File{}, &Problems{Path: path, Errs: d.errs}
	}
	f.digest, f.schemas = sha256.Sum256(data), schemas
	return f, nil
}

// decoder is the state of one load; its keys are spelled as in config.yaml.
type decoder struct {
	file  string
	env   *viper.Viper
	errs  []error
	lines map[string]int      // key -> its line in the file
	from  map[string]string   // key -> the variable that set it
	vars  map[string][]string // variable -> the keys it would set
	bad   map[string]bool     // keys whose value could not be decoded
}

// decode sets v, at key, from n (nil: not in the file) or the key's variable.
func (d *decoder) decode(key string, n *yaml.Node, v reflect.Value) {
	switch t := v.Type(); {
	case t.Kind() == reflect.Pointer: // nil unless the file or a variable sets a key below
		p, set := reflect.New(t.Elem()), len(d.from)
		if d.decode(key, n, p.Elem()); n != nil || len(d.from) > set {
			v.Set(p)
		}
	case t.Kind() == reflect.Struct:
		fs, nodes := fieldsOf(t), map[string]*yaml.Node{}
		d.pairs(key, n, t, strings.ToLower, func(k, val *yaml.Node) { // keys are case-insensitive
			name := strings.ToLower(k.Value)
			if nodes[name] = val; !slices.ContainsFunc(fs, func(f field) bool { return f.name == name }) {
				d.add(join(key, name), "unknown key; known keys here are %s", names(fs))
			}
		})
		for _, f := range fs {
			d.decode(join(key, f.name), nodes[f.name], v.FieldByIndex(f.index))
		}
	case t.Kind() == reflect.Map: // of names, kept as written
		d.pairs(key, n, t, func(s string) string { return s }, func(k, val *yaml.Node) {
			if v.IsNil() {
				v.Set(reflect.MakeMap(t))
			}
			entry := reflect.New(t.Elem()).Elem()
			d.decode(join(key, k.Value), val, entry)
			v.SetMapIndex(reflect.ValueOf(k.Value), entry)
		})
	case t.Kind() == reflect.Slice && t.Elem().Kind() == reflect.Struct: // gateway.limits
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
				d.from[key], n = name, &yaml.Node{Kind: yaml.ScalarNode, Style: yaml.DoubleQuotedStyle, Value: s}
			}
		}
		if n != nil && !set(v, n) {
			d.wrong(key, t, describe(n))
		}
	}
}

// pairs calls each with the keys and values of n, a mapping for t, those
// merged into it (<<: *anchor) included unless n sets them itself, and
// notes each key's line. A key set twice, as fold spells it, is a problem.
func (d *decoder) pairs(key string, n *yaml.Node, t reflect.Type, fold func(string) string, each func(k, val *yaml.Node)) {
	if n == nil || !d.shape(key, n, yaml.MappingNode, t) {
		return
	}
	own, merged := map[string]int{}, []*yaml.Node{}
	for i := 0; i+1 < len(n.Content); i += 2 {
		k, val, name := n.Content[i], deref(n.Content[i+1]), fold(n.Content[i].Value)
		d.lines[join(key, name)] = k.Line
		switch first, twice := own[name]; {
		case k.ShortTag() == "!!merge" && val != nil && val.Kind == yaml.SequenceNode:
			merged = append(merged, val.Content...)
		case k.ShortTag() == "!!merge":
			merged = append(merged, val)
		case twice:
			d.add(join(key, name), "set twice; first at line %d", first)
		default:
			own[name] = k.Line
			each(k, val)
		}
	}
	for _, m := range merged {
		d.pairs(key, deref(m), t, fold, func(k, val *yaml.Node) {
			if _, set := own[fold(k.Value)]; !set {
				each(k, val)
			}
		})
	}
}

// shape reports whether n is of kind, and if not, adds the problem.
func (d *decoder) shape(key string, n *yaml.Node, kind yaml.Kind, t reflect.Type) bool {
	if n.Kind != kind {
		d.wrong(key, t, describe(n))
	}
	return n.Kind == kind
}

// wrong adds the problem of key, whose value (got) is not of type t.
func (d *decoder) wrong(key string, t reflect.Type, got string) {
	d.bad[key] = true
	d.add(key, "must be %s, got %s", want(t), got)
}

// add adds a problem of key, at the variable that set it or a key above it,
// else at the line of the nearest of them in the file.
func (d *decoder) add(key, format string, args ...any) {
	p := &Problem{File: d.file, Path: key, Msg: fmt.Sprintf(format, args...)}
	for _, k := range parents(key) {
		if p.Env = d.from[k]; p.Env != "" {
			break
		}
		if p.Line = d.lines[k]; p.Line != 0 {
			break
		}
	}
	d.errs = append(d.errs, p)
}

// set sets v from n, a value of the file or a variable's (a quoted string):
// YAML decodes it, a string as if unquoted ("42", "true", "1s"), but a whole
// number must be one; a list may be one comma-separated string.
func set(v reflect.Value, n *yaml.Node) bool {
	var items []string
	switch {
	case v.Kind() == reflect.Slice && n.Kind == yaml.ScalarNode && n.ShortTag() == "!!str":
		for item := range strings.SplitSeq(n.Value, ",") {
			if item = strings.TrimSpace(item); item != "" {
				items = append(items, item)
			}
		}
	case v.Kind() == reflect.Slice && n.Kind == yaml.SequenceNode:
		return n.Decode(v.Addr().Interface()) == nil
	case n.Kind != yaml.ScalarNode || v.Kind() == reflect.Slice:
		return false
	case v.Kind() == reflect.String:
		v.SetString(n.Value)
		return true
	default:
		n = &yaml.Node{Kind: yaml.ScalarNode, Value: n.Value}
		return n.ShortTag() != "!!float" && n.Decode(v.Addr().Interface()) == nil // yaml would truncate 1.5
	}
	v.Set(reflect.ValueOf(items))
	return true
}

// describe shows a value of the file in a problem.
func describe(n *yaml.Node) string {
	if shape, ok := map[yaml.Kind]string{yaml.MappingNode: "a mapping", yaml.SequenceNode: "a list"}[n.Kind]; ok {
		return shape
	}
	return strconv.Quote(n.Value)
}

// deref is the value n stands for: nil for none (an empty file, "idle:"
// with no value), the anchored node for an alias (*anchor).
func deref(n *yaml.Node) *yaml.Node {
	switch {
	case n == nil || n.Kind == 0 || n.ShortTag() == "!!null":
		return nil
	case n.Kind == yaml.AliasNode:
		return deref(n.Alias)
	case n.Kind == yaml.DocumentNode:
		return deref(n.Content[0])
	}
	return n
}
