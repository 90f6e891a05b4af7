package config

import (
	"bytes"
	"crypto/sha256"
	"errors"
	"fmt"
	"iter"
	"maps"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode"

	"github.com/go-viper/mapstructure/v2"
	"github.com/spf13/viper"
	"go.yaml.in/yaml/v3"
)

// delim separates the parts of a viper key: names of quotas (api.example.com)
// and task types (http:request) contain dots and single colons.
const delim = "::"

// load reads data, the content of the file at path, with viper and decodes
// it into a File: see the package doc for the rules.
func load(path string, data []byte) (File, error) {
	v := viper.NewWithOptions(viper.KeyDelimiter(delim), viper.EnvKeyReplacer(envReplacer{}))
	v.SetConfigType("yaml")
	v.SetEnvPrefix("SLUICE")
	v.AutomaticEnv()
	if err := v.ReadConfig(bytes.NewReader(data)); err != nil {
		return File{}, &Problems{Path: path, Errs: notYAML(err)}
	}
	r := reader{env: map[string][]string{}, from: map[string]string{}, bad: map[string]bool{}}
	r.errs = checkNames(data)
	var f File
	r.bind(v, "", reflect.ValueOf(&f).Elem())
	r.checkEnv()
	// Two passes: mapstructure drops a whole map entry (a queue, a quota)
	// when any of its keys fails, an unknown key included, which would show
	// its good values as unset. The first pass, with unknown keys as
	// errors, only reports; the second decodes everything but them.
	r.addDecodeErrors(v.Unmarshal(&File{}, decoderConfig(true)))
	_ = v.Unmarshal(&f, decoderConfig(false)) // its errors are the first pass's, less the unknown keys
	f = f.Defaults()
	for _, err := range f.Validate() {
		key, _, _ := strings.Cut(err.Error(), ": ")
		if !r.unread(key) {
			r.errs = append(r.errs, fmt.Errorf("%w%s", err, r.source(key)))
		}
	}
	schemas, errs := compileSchemas(f, filepath.Dir(path))
	r.errs = append(r.errs, errs...)
	if len(r.errs) > 0 {
		return File{}, &Problems{Path: path, Errs: r.errs}
	}
	f.digest = sha256.Sum256(data)
	f.schemas = schemas
	return f, nil
}

// decoderConfig is how mapstructure decodes a File; errorUnused makes
// unknown keys errors.
func decoderConfig(errorUnused bool) viper.DecoderConfigOption {
	return func(c *mapstructure.DecoderConfig) {
		c.TagName = "config" // for File.Jobs's squash
		c.MatchName = func(key, field string) bool { return key == snakeCase(field) }
		c.DecodeHook = convert
		c.WeaklyTypedInput = false // convert does the conversions that are wanted
		c.ErrorUnused = errorUnused
	}
}

// reader collects the problems of one load. Keys are spelled as in
// config.yaml: queues.emails.drain.limit, redis.cluster[1].
type reader struct {
	errs []error
	env  map[string][]string // variable -> the keys bound to it
	from map[string]string   // key -> the non-empty variable that sets it
	bad  map[string]bool     // keys that could not be decoded
}

// bind binds every key below key (a viper key) of val's type to its
// environment variable, so that AutomaticEnv's variables reach keys the file
// leaves out, and gives val's maps an entry for every name the file gives:
// viper drops a name with no keys (bulk: {}), and mapstructure drops an entry
// it cannot decode, which would make a task's quota look undeclared.
func (r *reader) bind(v *viper.Viper, key string, val reflect.Value) {
	switch val.Kind() {
	case reflect.Struct:
		for _, f := range fieldsOf(val.Type()) {
			r.bind(v, join(key, f.name, delim), val.FieldByIndex(f.index))
		}
		return
	case reflect.Pointer:
		r.bind(v, key, reflect.New(val.Type().Elem()).Elem())
		return
	case reflect.Map:
		val.Set(reflect.MakeMap(val.Type()))
		for name := range v.GetStringMap(key) {
			entry := reflect.New(val.Type().Elem()).Elem()
			r.bind(v, join(key, name, delim), entry)
			val.SetMapIndex(reflect.ValueOf(name), entry)
		}
		return
	case reflect.Slice:
		if val.Type().Elem().Kind() != reflect.String {
			return // the items of gateway.limits have no names to spell a variable with
		}
	}
	_ = v.BindEnv(key) // fails only when given no key
	// The variable, spelled as viper spells it.
	name := envReplacer{}.Replace(strings.ToUpper("SLUICE_" + key))
	r.env[name] = append(r.env[name], strings.ReplaceAll(key, delim, "."))
}

// checkEnv notes which keys the environment sets, and reports variables
// that set more than one.
func (r *reader) checkEnv() {
	for _, name := range slices.Sorted(maps.Keys(r.env)) {
		keys := r.env[name]
		switch {
		case os.Getenv(name) == "":
		case len(keys) > 1:
			slices.Sort(keys)
			r.errs = append(r.errs, fmt.Errorf("%s: would set each of %s; rename one of them or set the key in the file", name, strings.Join(keys, ", ")))
		default:
			r.from[keys[0]] = name
		}
	}
}

// addDecodeErrors adds a problem for each of mapstructure's errors, sorted by
// key. A decoding error in a queue, quota or task type leaves that whole
// entry zero, so it is not validated either.
func (r *reader) addDecodeErrors(err error) {
	var errs []error
	for err := range decodeErrors(err) {
		de, ok := err.(*mapstructure.DecodeError)
		if !ok {
			errs = append(errs, err)
			continue
		}
		key, entry, t := keyPath(de.Name())
		msg := de.Unwrap().Error()
		// mapstructure's ErrorUnused names all unknown keys of a mapping at once.
		if unknown, ok := strings.CutPrefix(msg, "has invalid keys: "); ok {
			for _, k := range strings.Split(unknown, ", ") {
				errs = append(errs, fmt.Errorf("%s: unknown key; known keys here are %s", join(key, k, "."), names(fieldsOf(t))))
			}
			continue
		}
		r.bad[key] = true
		if entry != "" {
			r.bad[entry] = true
		}
		errs = append(errs, fmt.Errorf("%s: %s%s", key, msg, r.source(key)))
	}
	slices.SortStableFunc(errs, func(a, b error) int { return strings.Compare(a.Error(), b.Error()) })
	r.errs = append(r.errs, errs...)
}

// decodeErrors yields mapstructure's errors one by one: it returns them
// wrapped, in a tree of errors.Join.
func decodeErrors(err error) iter.Seq[error] {
	return func(yield func(error) bool) {
		var walk func(error) bool
		walk = func(err error) bool {
			if _, ok := err.(*mapstructure.DecodeError); ok {
				return yield(err)
			}
			switch e := err.(type) {
			case interface{ Unwrap() []error }:
				for _, err := range e.Unwrap() {
					if !walk(err) {
						return false
					}
				}
				return true
			case interface{ Unwrap() error }:
				return walk(e.Unwrap())
			}
			return err == nil || yield(err)
		}
		walk(err)
	}
}

// keyPath turns a field name as mapstructure reports it
// (Queues[emails].Drain.Period) into the key as config.yaml spells it
// (queues.emails.drain.period), and returns the type at that key and the key
// of the map entry that holds it, if any (queues.emails).
func keyPath(name string) (key, entry string, t reflect.Type) {
	t = reflect.TypeFor[File]()
	for name = strings.TrimPrefix(name, "."); name != ""; name = strings.TrimPrefix(name, ".") {
		switch t.Kind() {
		case reflect.Struct:
			end := strings.IndexAny(name, ".[")
			if end < 0 {
				end = len(name)
			}
			fs := fieldsOf(t)
			i := slices.IndexFunc(fs, func(f field) bool { return f.goName == name[:end] })
			if i < 0 {
				return join(key, name, "."), entry, t
			}
			key, t, name = join(key, fs[i].name, "."), fs[i].typ, name[end:]
		case reflect.Map, reflect.Slice:
			end := strings.Index(name, "]")
			if !strings.HasPrefix(name, "[") || end < 0 {
				return join(key, name, "."), entry, t
			}
			if t.Kind() == reflect.Map {
				key = join(key, name[1:end], ".")
				entry = key
			} else {
				key += name[:end+1]
			}
			t, name = t.Elem(), name[end+1:]
		default:
			return join(key, name, "."), entry, t
		}
		if t.Kind() == reflect.Pointer {
			t = t.Elem()
		}
	}
	return key, entry, t
}

var durationType = reflect.TypeFor[time.Duration]()

// convert is the decode hook: it turns data, a value from the file or the
// environment (where every value is a string: "42", "true", "1s",
// "h1:6379,h2:6379"), into the type of its key, or says what the key must be.
func convert(from, to reflect.Type, data any) (any, error) {
	s, isString := data.(string)
	switch k := from.Kind(); {
	case to == durationType:
		if d, err := time.ParseDuration(s); isString && err == nil {
			return d, nil
		}
		return nil, fmt.Errorf("must be a duration with a unit, like 1s, 500ms or 5m, got %s", describe(data))
	case to.Kind() == reflect.Int:
		if i, err := strconv.Atoi(s); isString && err == nil {
			return i, nil
		}
		if k < reflect.Int || k > reflect.Uint64 {
			return nil, fmt.Errorf("must be a whole number, got %s", describe(data))
		}
	case to.Kind() == reflect.Bool:
		if b, err := strconv.ParseBool(s); isString && err == nil {
			return b, nil
		}
		if k != reflect.Bool {
			return nil, fmt.Errorf("must be true or false, got %s", describe(data))
		}
	case to.Kind() == reflect.String:
		if k == reflect.Map || k == reflect.Slice {
			return nil, fmt.Errorf("must be a string, got %s", describe(data))
		}
		return fmt.Sprint(data), nil
	case to.Kind() == reflect.Slice:
		if isString && to.Elem().Kind() == reflect.String {
			var items []string
			for item := range strings.SplitSeq(s, ",") {
				if item = strings.TrimSpace(item); item != "" {
					items = append(items, item)
				}
			}
			return items, nil
		}
		if k != reflect.Slice {
			return nil, fmt.Errorf("must be a list, like [a, b], got %s", describe(data))
		}
	case to.Kind() == reflect.Map && k != reflect.Map:
		return nil, fmt.Errorf("must be a mapping of names, got %s", describe(data))
	case to.Kind() == reflect.Struct && k != reflect.Map:
		return nil, fmt.Errorf("must be a mapping with keys %s, got %s", names(fieldsOf(to)), describe(data))
	}
	return data, nil
}

// describe shows a value in a problem message.
func describe(data any) string {
	switch reflect.ValueOf(data).Kind() {
	case reflect.Map:
		return "a mapping"
	case reflect.Slice:
		return "a list"
	}
	return strconv.Quote(fmt.Sprint(data))
}

// checkNames reports the names of queues, quotas and task types that viper
// would change: it folds keys to lower case (asynq would then serve another
// queue than the one producers enqueue to), and splits them at delim.
func checkNames(data []byte) []error {
	var doc map[string]any
	if yaml.Unmarshal(data, &doc) != nil {
		return nil // viper has read it, so this does not happen
	}
	var errs []error
	check := func(key, name string, hint string) {
		switch {
		case name != strings.ToLower(name):
			errs = append(errs, fmt.Errorf("%s.%s: names must be lower case (config keys are case-insensitive)%s", key, name, hint))
		case strings.Contains(name, delim) || strings.HasSuffix(name, ":"):
			errs = append(errs, fmt.Errorf("%s.%s: names must not contain %q or end in \":\"", key, name, delim))
		}
	}
	// Key values named under overrides and fairness weights are names too.
	nested := func(key string, m map[string]any, path ...string) {
		for _, p := range path {
			m, _ = m[p].(map[string]any)
		}
		for _, name := range slices.Sorted(maps.Keys(m)) {
			check(key+"."+strings.Join(path, "."), name, "; a key expression can give lower case with lowerAscii()")
		}
	}
	for _, section := range []string{"queues", "quotas", "tasks"} {
		entries, _ := doc[section].(map[string]any)
		for _, name := range slices.Sorted(maps.Keys(entries)) {
			check(section, name, "")
			entry, _ := entries[name].(map[string]any)
			key := section + "." + name
			switch section {
			case "queues":
				nested(key, entry, "drain", "overrides")
				nested(key, entry, "fairness", "weights")
			case "quotas":
				nested(key, entry, "overrides")
			}
		}
	}
	return errs
}

// notYAML is the problems of a file that is not valid YAML.
func notYAML(err error) []error {
	var te *yaml.TypeError
	if !errors.As(err, &te) {
		return []error{fmt.Errorf("not valid YAML: %w", errors.Unwrap(err))}
	}
	errs := make([]error, len(te.Errors))
	for i, e := range te.Errors {
		errs[i] = fmt.Errorf("not valid YAML: %s", e) // "line 4: mapping key "redis" already defined at line 1"
	}
	return errs
}

// envReplacer spells a key, as viper passes it (SLUICE_QUEUES::EMAILS::PRIORITY),
// as its variable: the delimiter and every character other than an ASCII
// letter or digit become "_".
type envReplacer struct{}

func (envReplacer) Replace(s string) string {
	return strings.Map(func(r rune) rune {
		if r < unicode.MaxASCII && (unicode.IsLetter(r) || unicode.IsDigit(r)) {
			return r
		}
		return '_'
	}, strings.ReplaceAll(s, delim, "_"))
}

// source says which variable set key, or the nearest key above it.
func (r *reader) source(key string) string {
	for k := range keyAndParents(key) {
		if name, ok := r.from[k]; ok {
			return " (from " + name + ")"
		}
	}
	return ""
}

// unread reports whether key, or a key above it, could not be decoded: its
// problem is reported already and would only be repeated by validation.
func (r *reader) unread(key string) bool {
	for k := range keyAndParents(key) {
		if r.bad[k] {
			return true
		}
	}
	return false
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

func join(key, name, sep string) string {
	if key == "" {
		return name
	}
	return key + sep + name
}

type field struct {
	name, goName string
	index        []int
	typ          reflect.Type
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
				fs = append(fs, field{sub.name, sub.goName, append(slices.Clone(f.Index), sub.index...), sub.typ})
			}
			continue
		}
		fs = append(fs, field{snakeCase(f.Name), f.Name, f.Index, f.Type})
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
