package throttle

import (
	"strings"
	"testing"
)

func TestHashTagIsInjectiveAndClosed(t *testing.T) {
	keys := []string{
		"", "%", "%25", "a", "a:b", "a:b:c", "{a}", "a}", "{a", "}{", "a{b}c", "%7B", "#", "%23",
		"\x00", " ", "é", "a b", strings.Repeat("x", maxTagLen), strings.Repeat("x", maxTagLen+1),
		strings.Repeat("{", maxTagLen), strings.Repeat("{", maxTagLen) + "!",
	}
	seen := map[string]string{}
	for _, k := range keys {
		tag := hashTag(k)
		if strings.ContainsAny(tag, "{} ") {
			t.Errorf("hashTag(%q) = %q contains a brace or a space", k, tag)
		}
		if len(tag) > maxTagLen+3 {
			t.Errorf("hashTag(%q) is %d bytes long, want at most %d", k, len(tag), maxTagLen+3)
		}
		if other, dup := seen[tag]; dup {
			t.Errorf("hashTag(%q) = hashTag(%q) = %q", k, other, tag)
		}
		seen[tag] = k
	}
}

func TestRedisKeyKeepsPrefixAndKeyApart(t *testing.T) {
	// "a:" + "b" and "a:b" + "" must not meet, nor "a" + "b:c" and "a:b" + "c".
	pairs := [][2][2]string{
		{{"a:", "b"}, {"a:b", ""}},
		{{"a", "b:c"}, {"a:b", "c"}},
		{{"p:", "x}{y"}, {"p:x}", "{y"}},
	}
	for _, p := range pairs {
		k1, k2 := redisKey(p[0][0], p[0][1]), redisKey(p[1][0], p[1][1])
		if k1 == k2 {
			t.Errorf("redisKey%q = redisKey%q = %q", p[0], p[1], k1)
		}
	}
}
