package jobs

import (
	"encoding/json"
	"reflect"
	"unicode/utf8"

	"github.com/google/cel-go/common/types"
	"github.com/google/cel-go/common/types/ref"
	"github.com/google/cel-go/common/types/traits"
	"github.com/tidwall/gjson"
)

// A key expression usually looks at one or two fields of a task's payload
// (payload.tenant, payload.headers["X-Dest"]), once per task: decoding the
// whole payload for that (encoding/json into maps) cost a keyed gate more
// than its turn. So the payload is valid JSON checked once (json.Valid,
// which also bounds its nesting), then read where an expression looks
// (gjson), field by field. An object or array is a value of its own that
// reads its fields when asked; what an expression does with a whole one
// (compare it, iterate it, take its size, convert it) decodes it with
// encoding/json, so every result is the one the decoded payload gives.
// A lazy read walks the object or array (fast: gjson skips what it does
// not read, about 100 times faster than decoding it), so a read done again
// (payload.want in payload.items.exists(x, x == payload.want)) gives the
// value the last read gave, and after maxWalks walks the object or array
// is decoded whole.

// jsonVal is the CEL value of the JSON value r: a string, number (a
// double, as encoding/json decodes it), bool or null; an object or array
// read lazily.
func jsonVal(r gjson.Result) ref.Val {
	switch r.Type {
	case gjson.String:
		return types.String(jsonString(r))
	case gjson.Number:
		return types.Double(r.Num)
	case gjson.True:
		return types.True
	case gjson.False:
		return types.False
	case gjson.JSON:
		if r.IsArray() {
			return &jsonArray{jsonWhole{raw: r.Raw}}
		}
		return &jsonObject{jsonWhole{raw: r.Raw}}
	}
	return types.NullValue
}

// jsonString is the string r, an object's key or a string value, as
// encoding/json decodes it: invalid UTF-8 replaced byte by byte.
func jsonString(r gjson.Result) string {
	s := r.String()
	if !utf8.ValidString(s) {
		_ = json.Unmarshal([]byte(r.Raw), &s)
	}
	return s
}

// maxWalks bounds the walks of one object's or array's raw JSON for
// reads (of different fields or elements: see jsonWhole.read); beyond it,
// reads are from the value decoded whole, so that an expression's reads
// cost at most about one decoding more than it.
const maxWalks = 16

// jsonWhole is an object's or an array's raw JSON, and its value decoded
// whole, once something needs it.
type jsonWhole struct {
	raw     string
	decoded ref.Val
	walks   int
	// The last read that walked, and what it found (nil for nothing),
	// given again to a read of the same.
	lastAt readAt
	last   ref.Val
}

// readAt is what a read reads: an object's field, an array's element, or
// the size of either (sizeRead).
type readAt struct {
	field string
	index int
	size  bool
}

var sizeRead = readAt{size: true}

// read is what walk finds at, or false if walking is done with: decoded,
// or walked maxWalks times.
func (w *jsonWhole) read(at readAt, walk func() ref.Val) (v ref.Val, ok bool) {
	if w.walks > 0 && at == w.lastAt {
		return w.last, true
	}
	if w.decoded != nil || w.walks == maxWalks {
		return nil, false
	}
	w.walks++
	w.lastAt, w.last = at, walk()
	return w.last, true
}

// field is the value r found, or nil if it found nothing.
func field(r gjson.Result) ref.Val {
	if !r.Exists() {
		return nil
	}
	return jsonVal(r)
}

// whole is the value encoding/json decodes, as CEL adapts it: a map or a
// list, with every trait the methods below assert (raw is part of a
// document json.Valid passed, so it decodes; were it not, the assertion's
// panic is CEL's Eval's error, and the task takes the default key).
func (w *jsonWhole) whole() ref.Val {
	if w.decoded == nil {
		var v any
		if err := json.Unmarshal([]byte(w.raw), &v); err != nil {
			w.decoded = types.NewErr("payload: %v", err) // json.Valid passed: not expected
		} else {
			w.decoded = types.DefaultTypeAdapter.NativeToValue(v)
		}
	}
	return w.decoded
}

func (w *jsonWhole) ConvertToNative(t reflect.Type) (any, error) { return w.whole().ConvertToNative(t) }
func (w *jsonWhole) ConvertToType(t ref.Type) ref.Val            { return w.whole().ConvertToType(t) }
func (w *jsonWhole) Equal(other ref.Val) ref.Val                 { return w.whole().Equal(other) }
func (w *jsonWhole) Value() any                                  { return w.whole().Value() }
func (w *jsonWhole) Contains(v ref.Val) ref.Val                  { return w.whole().(traits.Container).Contains(v) }
func (w *jsonWhole) Iterator() traits.Iterator                   { return w.whole().(traits.Iterable).Iterator() }

// jsonObject is a JSON object: a CEL map whose fields are read when
// asked.
type jsonObject struct{ jsonWhole }

var _ traits.Mapper = (*jsonObject)(nil)

func (o *jsonObject) Type() ref.Type { return types.MapType }

// Find reads the field key: the last of that name, as encoding/json
// decodes an object that names a field twice.
func (o *jsonObject) Find(key ref.Val) (ref.Val, bool) {
	name, ok := key.(types.String)
	if !ok {
		return o.whole().(traits.Mapper).Find(key)
	}
	found, ok := o.read(readAt{field: string(name)}, func() ref.Val {
		var found gjson.Result
		gjson.Parse(o.raw).ForEach(func(k, v gjson.Result) bool {
			if jsonString(k) == string(name) {
				found = v
			}
			return true
		})
		return field(found)
	})
	if !ok {
		return o.whole().(traits.Mapper).Find(key)
	}
	return found, found != nil
}

func (o *jsonObject) Get(key ref.Val) ref.Val {
	if v, ok := o.Find(key); ok {
		return v
	}
	return o.whole().(traits.Indexer).Get(key) // its error for a missing key
}

// Size counts the fields when there are fewer than 2, and otherwise the
// fields of the object decoded whole: a field named twice counts once.
func (o *jsonObject) Size() ref.Val {
	n, ok := o.read(sizeRead, func() ref.Val {
		n := 0
		gjson.Parse(o.raw).ForEach(func(_, _ gjson.Result) bool { n++; return n < 2 })
		return types.Int(n)
	})
	if !ok || n.(types.Int) > 1 {
		return o.whole().(traits.Sizer).Size()
	}
	return n
}

// jsonArray is a JSON array: a CEL list whose elements are read when
// asked.
type jsonArray struct{ jsonWhole }

var _ traits.Lister = (*jsonArray)(nil)

func (a *jsonArray) Type() ref.Type { return types.ListType }

func (a *jsonArray) Get(index ref.Val) ref.Val {
	i, err := types.IndexOrError(index)
	if err != nil {
		return types.WrapErr(err)
	}
	found, ok := a.read(readAt{index: i}, func() ref.Val {
		var found gjson.Result
		n := 0
		gjson.Parse(a.raw).ForEach(func(_, v gjson.Result) bool {
			if n == i {
				found = v
				return false
			}
			n++
			return true
		})
		return field(found)
	})
	if !ok || found == nil {
		return a.whole().(traits.Indexer).Get(index) // its error for an index out of range
	}
	return found
}

func (a *jsonArray) Size() ref.Val {
	n, ok := a.read(sizeRead, func() ref.Val {
		n := 0
		gjson.Parse(a.raw).ForEach(func(_, _ gjson.Result) bool { n++; return true })
		return types.Int(n)
	})
	if !ok {
		return a.whole().(traits.Sizer).Size()
	}
	return n
}

func (a *jsonArray) Add(other ref.Val) ref.Val { return a.whole().(traits.Adder).Add(other) }
