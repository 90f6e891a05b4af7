package algorithms

import (
	"context"
	"fmt"
	"strconv"

	"github.com/redis/go-redis/v9"
)

// Script is an algorithm's Lua script, run by its SHA1 with a fallback to
// its body when Redis does not have it cached (after a restart, a failover
// or SCRIPT FLUSH), so that an empty script cache costs no decision.
type Script struct {
	source string
	script *redis.Script
}

func newScript(source string) *Script { return &Script{source: source, script: redis.NewScript(source)} }

// Source returns the full text of the script.
func (s *Script) Source() string { return s.source }

// Hash returns the script's SHA1, the name EVALSHA knows it by.
func (s *Script) Hash() string { return s.script.Hash() }

// Load caches the script on the server(s) rdb talks to.
func (s *Script) Load(ctx context.Context, rdb redis.Scripter) error {
	return s.script.Load(ctx, rdb).Err()
}

// Now asks a script to read Redis's own clock.
const Now int64 = -1

// Run makes the algorithm's transition on the key at now (µs, or Now for
// Redis TIME) for n events. slack (µs) is added to the TTL the script sets.
func (s *Script) Run(ctx context.Context, rdb redis.Scripter, key string, p Params, now, n, slack int64) (Result, error) {
	clock := ""
	if now != Now {
		clock = strconv.FormatInt(now, 10)
	}
	reply, err := s.script.Run(ctx, rdb, []string{key},
		clock, p.Limit, p.Period, p.Burst, p.Windows, n, slack).Int64Slice()
	if err != nil {
		return Result{}, err
	}
	if len(reply) != 4 {
		return Result{}, fmt.Errorf("algorithms: script replied %v, want 4 integers", reply)
	}
	return Result{Allowed: reply[0] == 1, Remaining: reply[1], RetryAfter: reply[2], ResetAfter: reply[3]}, nil
}
