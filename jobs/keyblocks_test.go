package jobs

import (
	"fmt"
	"strings"
	"testing"
	"time"
)

// TestKeyBlocksBounded (issue 20.3): a worker keeps at most maxKeyBlocks
// blocks of keyed quotas' values, whatever the values' length: blocks that
// ended are swept first, then those that end first make room, and one that
// ends before every block kept is not kept. An announcement names a value
// by its digest only, and a keyed block's announcement is told apart from
// an unkeyed one's whose quota's name holds spaces.
func TestKeyBlocksBounded(t *testing.T) {
	now := time.Unix(1_000_000, 0)
	kb := newKeyBlocks(3)
	long := strings.Repeat("x", 1<<20)
	for i, until := range []time.Duration{time.Second, 2 * time.Second, 3 * time.Second} {
		kb.add(blockOfKey("q", fmt.Sprint(long, i)), now.Add(until), now)
	}
	kb.add(blockOfKey("q", "new"), now.Add(5*time.Second), now)
	if got := len(kb.until); got != 3 {
		t.Fatalf("%d blocks kept, want at most 3", got)
	}
	if !kb.blockedUntil(blockOfKey("q", fmt.Sprint(long, 0)), now).IsZero() {
		t.Errorf("the block that ends first is still kept after a later one needed room")
	}
	kb.add(blockOfKey("q", "short"), now.Add(time.Millisecond), now)
	if !kb.blockedUntil(blockOfKey("q", "short"), now).IsZero() {
		t.Errorf("a block that ends before every kept one took the room of one")
	}
	later := now.Add(2500 * time.Millisecond)
	kb.add(blockOfKey("q", "after"), later.Add(time.Second), later)
	if got, want := kb.blockedUntil(blockOfKey("q", "after"), later), later.Add(time.Second); !got.Equal(want) {
		t.Errorf("block added once the first had ended: until %v, want %v", got, want)
	}
	if !kb.blockedUntil(blockOfKey("q", "new"), now.Add(time.Hour)).IsZero() || !kb.blockedUntil(blockOfKey("q", "after"), now.Add(time.Hour)).IsZero() {
		t.Errorf("blocks that ended are still in force")
	}

	b := blockOfKey("my quota", "tok_secret")
	msg := b.announcement(2_000_000)
	if strings.Contains(msg, "tok_secret") {
		t.Errorf("announcement %q holds the key value", msg)
	}
	digest, rest, ok := parseKeyBlock(msg)
	if !ok || digest != b.digest || rest != "my quota 2000000" {
		t.Errorf("parseKeyBlock(%q) = %x, %q, %v; want %x, %q, true", msg, digest, rest, ok, b.digest, "my quota 2000000")
	}
	if _, _, ok := parseKeyBlock("k=1 2000000"); ok {
		t.Errorf("the unkeyed block of quota %q was read as a keyed one", "k=1")
	}
}
