package throttle

import (
	"context"
	"testing"

	"github.com/sluicehq/sluice/internal/redistest"
)

// TestKeySlot: keySlot agrees with the cluster's CLUSTER KEYSLOT, hash
// tags and their edge cases (an empty tag, an unclosed brace) included.
func TestKeySlot(t *testing.T) {
	rdb := redistest.Cluster(t)
	for _, key := range []string{"q", "{q}:wake", "sluice:wake:{q}", "a{}b{c}", "{}", "x{", "x}{y}", "{user1000}.following", "{a}{b}"} {
		want, err := rdb.ClusterKeySlot(context.Background(), key).Result()
		if err != nil {
			t.Fatal(err)
		}
		if got := keySlot(key); int64(got) != want {
			t.Errorf("keySlot(%q) = %d, CLUSTER KEYSLOT says %d", key, got, want)
		}
	}
}
