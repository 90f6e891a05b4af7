// Package strictjson decodes one JSON object strictly (no unknown field,
// nothing after it, not null) and says what was wrong in terms a person can
// act on: the byte of a syntax error, the field of a type error, the
// unknown key. Callers word the message for their input (a payload, a line
// of a file) from the Error's fields.
package strictjson

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"reflect"
	"strconv"
	"strings"
)

// Problem is what was wrong with the input.
type Problem int

// The problems Decode reports.
const (
	Empty        Problem = iota // no JSON value at all
	Truncated                   // the input ends inside the value
	Syntax                      // not JSON, at Offset
	NotObject                   // a JSON value that is not an object (Got)
	WrongType                   // Field holds Got where Type was wanted
	UnknownField                // Field is not a key the object has
	Trailing                    // data after the object, at Offset
)

// Error is the error Decode returns.
type Error struct {
	Problem Problem
	Offset  int64        // Truncated, Syntax, Trailing: the byte at fault
	Field   string       // WrongType, UnknownField: the key, dotted for nested objects
	Type    reflect.Type // WrongType: the Go type the field decodes into
	Got     string       // NotObject, WrongType: what the JSON held ("string", "null")
	Detail  string       // Syntax: the decoder's words
}

// Error says what was wrong, without naming the input.
func (e *Error) Error() string {
	switch e.Problem {
	case Empty:
		return "empty, want a JSON object"
	case Truncated:
		return fmt.Sprintf("invalid JSON at byte %d: unexpected end of input", e.Offset)
	case Syntax:
		return fmt.Sprintf("invalid JSON at byte %d: %s", e.Offset, e.Detail)
	case NotObject:
		return "want a JSON object, got " + e.Got
	case WrongType:
		return fmt.Sprintf("field %q: want a JSON value for a Go %v, got %s", e.Field, e.Type, e.Got)
	case UnknownField:
		return fmt.Sprintf("unknown field %q", e.Field)
	}
	return fmt.Sprintf("invalid JSON at byte %d: data after the first value", e.Offset)
}

// Decode decodes data, one JSON object, into v; a problem is an *Error.
func Decode(data []byte, v any) error {
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	err := dec.Decode(v)
	var syntax *json.SyntaxError
	var typ *json.UnmarshalTypeError
	switch {
	case err == io.EOF:
		return &Error{Problem: Empty}
	case err == io.ErrUnexpectedEOF:
		return &Error{Problem: Truncated, Offset: int64(len(data))}
	case errors.As(err, &syntax):
		return &Error{Problem: Syntax, Offset: syntax.Offset, Detail: strings.TrimPrefix(syntax.Error(), "json: ")}
	case errors.As(err, &typ) && typ.Field == "":
		return &Error{Problem: NotObject, Got: typ.Value}
	case errors.As(err, &typ):
		return &Error{Problem: WrongType, Field: typ.Field, Type: typ.Type, Got: typ.Value}
	case err != nil:
		// The decoder names an unknown key only in its message:
		// `json: unknown field "x"`.
		if name, ok := strings.CutPrefix(err.Error(), "json: unknown field "); ok {
			if field, err := strconv.Unquote(name); err == nil {
				return &Error{Problem: UnknownField, Field: field}
			}
		}
		return err
	}
	if rest := bytes.TrimLeft(data[dec.InputOffset():], " \t\r\n"); len(rest) > 0 {
		return &Error{Problem: Trailing, Offset: int64(len(data) - len(rest))}
	}
	// null decodes into a struct without error; every other value that is
	// not an object failed as a type error above.
	if bytes.Equal(bytes.TrimSpace(data), []byte("null")) {
		return &Error{Problem: NotObject, Got: "null"}
	}
	return nil
}
