package strictjson

import (
	"errors"
	"testing"
)

func TestDecode(t *testing.T) {
	type inner struct {
		N int `json:"n"`
	}
	type target struct {
		A string `json:"a"`
		B inner  `json:"b"`
	}
	cases := []struct {
		desc  string
		input string
		want  *Error // nil: no error
	}{
		{"an object", `{"a": "x", "b": {"n": 1}}`, nil},
		{"spaces around it", " {\"a\": \"x\"}\n", nil},
		{"nothing", ``, &Error{Problem: Empty}},
		{"only spaces", `   `, &Error{Problem: Empty}},
		{"cut short", `{"a": "x"`, &Error{Problem: Truncated, Offset: 9}},
		{"not JSON", `{"a": x}`, &Error{Problem: Syntax, Offset: 7}},
		{"an array", `[1]`, &Error{Problem: NotObject, Got: "array"}},
		{"null", `null`, &Error{Problem: NotObject, Got: "null"}},
		{"a wrong type", `{"a": 5}`, &Error{Problem: WrongType, Field: "a", Got: "number"}},
		{"a wrong type inside", `{"b": {"n": "5"}}`, &Error{Problem: WrongType, Field: "b.n", Got: "string"}},
		{"an unknown key", `{"a": "x", "c": 1}`, &Error{Problem: UnknownField, Field: "c"}},
		{"data after it", `{"a": "x"} {}`, &Error{Problem: Trailing, Offset: 11}},
	}
	for _, c := range cases {
		t.Run(c.desc, func(t *testing.T) {
			var v target
			err := Decode([]byte(c.input), &v)
			if c.want == nil {
				if err != nil {
					t.Fatalf("Decode(%q) = %v, want no error", c.input, err)
				}
				return
			}
			var got *Error
			if !errors.As(err, &got) {
				t.Fatalf("Decode(%q) = %v, want an *Error", c.input, err)
			}
			if got.Problem != c.want.Problem || got.Field != c.want.Field || got.Got != c.want.Got ||
				(c.want.Offset != 0 && got.Offset != c.want.Offset) {
				t.Fatalf("Decode(%q) = %+v, want %+v", c.input, got, c.want)
			}
			if got.Error() == "" {
				t.Fatal("empty message")
			}
		})
	}
}
