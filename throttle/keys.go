package throttle

import (
	"crypto/sha256"
	"encoding/hex"
	"strings"
)

// maxTagLen bounds the caller's part of a key; longer ones are hashed.
const maxTagLen = 128

// Key returns the Redis key that holds state for key under prefix, the way
// every limiter of this package builds its keys: callers that keep state of
// their own next to a limiter's use it, so that caller input never lands
// raw in a key or its hash tag. The prefix may not contain '{' or '}'.
func Key(prefix, key string) string { return redisKey(prefix, key) }

// redisKey is the one place where a caller's key becomes a Redis key:
// prefix + "{" + tag + "}". The tag is the caller's key with every byte that
// could end or open a hash tag, '%' itself, '#', and every byte outside
// printable ASCII percent-escaped, so distinct keys give distinct tags, and no
// key can move itself to another cluster slot. Tags longer than maxTagLen
// become '#' + a hash: '#' never appears unescaped otherwise. The empty key
// becomes "%", which no escape produces (escapes are always "%XX").
func redisKey(prefix, key string) string {
	return prefix + "{" + hashTag(key) + "}"
}

// auxKey is the second key of a state (a sliding log's block, a bucket's
// spans). No redisKey ends in ":b", so it meets no other key, and it shares
// the state's cluster slot.
func auxKey(stateKey string) string {
	return stateKey + ":b"
}

// keptKey holds the turn kept under id on a state's key: after the hash
// tag, so in the state's slot, with id escaped as a tag is (no input can
// reach another key).
func keptKey(stateKey, id string) string {
	return stateKey + ":t:" + hashTag(id)
}

// recentKey counts a state's recent throttles (WithRecentThrottles): no
// redisKey ends in ":x", and it shares the state's cluster slot.
func recentKey(stateKey string) string {
	return stateKey + ":x"
}

func hashTag(key string) string {
	if key == "" {
		return "%"
	}
	if len(key) <= maxTagLen && !strings.ContainsFunc(key, needsEscape) {
		return key // most keys, as they are: no copy
	}
	const hexDigits = "0123456789ABCDEF"
	var b strings.Builder
	for i := 0; i < len(key); i++ {
		c := key[i]
		if needsEscape(rune(c)) {
			b.WriteByte('%')
			b.WriteByte(hexDigits[c>>4])
			b.WriteByte(hexDigits[c&15])
		} else {
			b.WriteByte(c)
		}
		if b.Len() > maxTagLen {
			sum := sha256.Sum256([]byte(key))
			return "#" + hex.EncodeToString(sum[:16])
		}
	}
	return b.String()
}

// needsEscape tells whether a byte of a caller's key is escaped in its tag
// (see redisKey): it could end or open a hash tag, is '%' or '#', or is not
// printable ASCII. (ContainsFunc passes bytes past ASCII as runes above '~'.)
func needsEscape(c rune) bool {
	return c == '{' || c == '}' || c == '%' || c == '#' || c <= ' ' || c > '~'
}
