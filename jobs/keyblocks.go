package jobs

import (
	"crypto/sha256"
	"encoding/hex"
	"strconv"
	"strings"
	"sync"
	"time"
)

// keyBlock names one value of a keyed quota that an upstream blocked. The
// value is held as its digest: the board and the announcements on
// blockChannel carry no key value (a customer's token, say), and an entry
// has the same size whatever the value's length.
type keyBlock struct {
	quota  string
	digest [16]byte
}

// blockOfKey is the keyBlock of claim key value key on quota.
func blockOfKey(quota, key string) keyBlock {
	sum := sha256.Sum256([]byte(key))
	b := keyBlock{quota: quota}
	copy(b.digest[:], sum[:])
	return b
}

// keyBlockField marks the last field of a keyed block's announcement:
// "<quota> <µs> k=<digest in hex>". A worker that does not know keyed
// announcements reads "k=..." as a bad duration and ignores the message.
const keyBlockField = "k="

// announcement is what blockChannel carries for b, blocked for us µs.
func (b keyBlock) announcement(us int64) string {
	return b.quota + " " + strconv.FormatInt(us, 10) + " " + keyBlockField + hex.EncodeToString(b.digest[:])
}

// parseKeyBlock splits a keyed block's announcement into its value's
// digest and the rest ("<quota> <µs>"); ok is false if payload is not one.
func parseKeyBlock(payload string) (digest [16]byte, rest string, ok bool) {
	i := strings.LastIndexByte(payload, ' ')
	if i < 0 || !strings.HasPrefix(payload[i+1:], keyBlockField) {
		return digest, "", false
	}
	b, err := hex.DecodeString(payload[i+1+len(keyBlockField):])
	if err != nil || len(b) != len(digest) {
		return digest, "", false
	}
	copy(digest[:], b)
	return digest, payload[:i], true
}

// maxKeyBlocks bounds the key values a worker keeps blocks of: each 429 on
// a keyed quota adds one for its Retry-After (at most the quota's
// max_block). Past it, blocks that ended are swept, then those that end
// first make room: their keys' turns booked before the block may be used,
// new turns are still kept out by the block in Redis.
const maxKeyBlocks = 10_000

// keyBlocks is the board of a worker's blocks on keyed quotas' values: the
// keyed twin of blockBoard.blocked, bounded (maxKeyBlocks).
type keyBlocks struct {
	mu    sync.Mutex
	until map[keyBlock]time.Time
	limit int
}

func newKeyBlocks(limit int) *keyBlocks {
	return &keyBlocks{until: map[keyBlock]time.Time{}, limit: limit}
}

// add notes that b may not be drawn on before until (now: the board's
// clock, for sweeping).
func (kb *keyBlocks) add(b keyBlock, until, now time.Time) {
	kb.mu.Lock()
	defer kb.mu.Unlock()
	if old, ok := kb.until[b]; ok {
		if until.After(old) {
			kb.until[b] = until
		}
		return
	}
	if len(kb.until) >= kb.limit {
		for k, u := range kb.until {
			if !u.After(now) {
				delete(kb.until, k)
			}
		}
	}
	for len(kb.until) >= kb.limit {
		first, firstUntil := keyBlock{}, time.Time{}
		for k, u := range kb.until {
			if firstUntil.IsZero() || u.Before(firstUntil) {
				first, firstUntil = k, u
			}
		}
		if !until.After(firstUntil) {
			return // it ends before every block kept: it makes no room
		}
		delete(kb.until, first)
	}
	kb.until[b] = until
}

// blockedUntil is when the block on b ends, or the zero Time if there is
// none in force at now (one that ended is dropped).
func (kb *keyBlocks) blockedUntil(b keyBlock, now time.Time) time.Time {
	kb.mu.Lock()
	defer kb.mu.Unlock()
	until, ok := kb.until[b]
	if !ok {
		return time.Time{}
	}
	if !until.After(now) {
		delete(kb.until, b)
		return time.Time{}
	}
	return until
}

// empty reports whether no block is kept: most tasks then skip working
// out their key values again.
func (kb *keyBlocks) empty() bool {
	kb.mu.Lock()
	defer kb.mu.Unlock()
	return len(kb.until) == 0
}
