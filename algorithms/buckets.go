package algorithms

import "github.com/sluicehq/sluice/lua"

// The two buckets keep their content exactly as an integer in units of
// 1/Period: one event is Period units, and Limit units flow per µs. No
// fraction of a token is ever rounded away, however often callers come.

// TokenBucket holds Burst tokens, starts full and refills continuously at
// Limit per Period; a call takes n tokens, or none when fewer are left.
var TokenBucket = &Algorithm{
	Name:     "token_bucket",
	NewState: func() State { return &TokenBucketState{} },
	Script:   newScript(lua.TokenBucket),
	Capacity: burstCapacity,
}

// LeakyBucket is a bucket of size Burst that starts empty and leaks
// continuously at Limit per Period; a call pours in n if they fit. With
// Burst 1 it spaces events exactly Period/Limit apart.
var LeakyBucket = &Algorithm{
	Name:     "leaky_bucket",
	NewState: func() State { return &LeakyBucketState{} },
	Script:   newScript(lua.LeakyBucket),
	Capacity: burstCapacity,
}

// TokenBucketState is the tokens left (× Period) after the last call counted.
type TokenBucketState struct {
	Set    bool  // false: a full bucket
	Tokens int64 // tokens × Period
	Last   int64 // µs
}

// refill returns the tokens at `at` and the instant they refill from: later
// than `at` when a call was counted after it (a reservation, or a clock that
// stepped back), and then nothing refills before that instant.
func (s *TokenBucketState) refill(p Params, at int64) (tokens, from int64) {
	capacity := p.Burst * p.Period
	if !s.Set {
		return capacity, at
	}
	tokens = min(capacity, s.Tokens)
	if at <= s.Last {
		return tokens, s.Last
	}
	if elapsed := at - s.Last; elapsed < ceilDiv(capacity-tokens, p.Limit) {
		return tokens + elapsed*p.Limit, at
	}
	return capacity, at
}

// Trim implements State: a bucket needs none.
func (s *TokenBucketState) Trim(Params, int64) {}

// Decide implements State; it mirrors decide in lua/token_bucket.lua.
func (s *TokenBucketState) Decide(p Params, at, n int64) Result {
	capacity, cost := p.Burst*p.Period, n*p.Period
	tokens, from := s.refill(p, at)
	// The tokens of a bucket counted up to a later instant exist from then
	// on only, so nothing fits before it (else a cancelled reservation would
	// give back tokens early).
	ahead := from - at
	if ahead > 0 || tokens < cost {
		remaining := int64(0)
		if ahead == 0 {
			remaining = floorDiv(tokens, p.Period)
		}
		return Result{
			Remaining:  remaining,
			RetryAfter: ahead + ceilDiv(max(0, cost-tokens), p.Limit),
			ResetAfter: ahead + ceilDiv(capacity-tokens, p.Limit),
		}
	}
	return Result{Allowed: true, Remaining: floorDiv(tokens-cost, p.Period), ResetAfter: ahead + ceilDiv(capacity-tokens+cost, p.Limit)}
}

// Record implements State.
func (s *TokenBucketState) Record(p Params, at, n int64) {
	tokens, from := s.refill(p, at)
	s.Set, s.Tokens, s.Last = true, tokens-n*p.Period, from
}

// GiveBack implements State. Tokens are given back only while nothing was
// counted after them: later calls were decided with them gone, and the
// bucket may have been full since, so giving them back then could overfill
// it.
func (s *TokenBucketState) GiveBack(p Params, at, n int64) {
	if s.Set && s.Last == at {
		s.Tokens = min(p.Burst*p.Period, s.Tokens+n*p.Period)
	}
}

// LeakyBucketState is the level (× Period) after the last call counted.
type LeakyBucketState struct {
	Set   bool  // false: an empty bucket
	Level int64 // events × Period
	Last  int64 // µs
}

// leak returns the level at `at` and the instant it leaks from: later than
// `at` when a call was counted after it (a reservation, or a clock that
// stepped back), and then nothing leaks before that instant.
func (s *LeakyBucketState) leak(p Params, at int64) (level, from int64) {
	if !s.Set {
		return 0, at
	}
	if at <= s.Last {
		return s.Level, s.Last
	}
	if elapsed := at - s.Last; elapsed < ceilDiv(s.Level, p.Limit) {
		return s.Level - elapsed*p.Limit, at
	}
	return 0, at
}

// Trim implements State: a bucket needs none.
func (s *LeakyBucketState) Trim(Params, int64) {}

// Decide implements State; it mirrors decide in lua/leaky_bucket.lua.
func (s *LeakyBucketState) Decide(p Params, at, n int64) Result {
	capacity, cost := p.Burst*p.Period, n*p.Period
	level, from := s.leak(p, at)
	// The level of a bucket counted up to a later instant holds from then on
	// only, so nothing fits before it (else a cancelled reservation would
	// make room early).
	ahead := from - at
	if ahead > 0 || level+cost > capacity {
		remaining := int64(0)
		if ahead == 0 {
			remaining = floorDiv(max(0, capacity-level), p.Period)
		}
		return Result{
			Remaining:  remaining,
			RetryAfter: ahead + ceilDiv(max(0, level+cost-capacity), p.Limit),
			ResetAfter: ahead + ceilDiv(level, p.Limit),
		}
	}
	return Result{Allowed: true, Remaining: floorDiv(capacity-level-cost, p.Period), ResetAfter: ahead + ceilDiv(level+cost, p.Limit)}
}

// Record implements State.
func (s *LeakyBucketState) Record(p Params, at, n int64) {
	level, from := s.leak(p, at)
	s.Set, s.Level, s.Last = true, level+n*p.Period, from
}

// GiveBack implements State. Room is made only while nothing was counted
// after the events given back: later calls were decided with them in, and
// the bucket may have run empty since, so making room then could let it
// overflow.
func (s *LeakyBucketState) GiveBack(p Params, at, n int64) {
	if s.Set && s.Last == at {
		s.Level = max(0, s.Level-n*p.Period)
	}
}
