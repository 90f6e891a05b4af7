package algorithms

import "github.com/sluicehq/sluice/lua"

// The two buckets keep their content exactly as an integer in units of
// 1/Period: one event is Period units, and Limit units flow per µs. No
// fraction of a token is ever rounded away, however often callers come.

// TokenBucket holds Burst tokens, starts full and refills continuously at
// Limit per Period; a call takes n tokens, or none when fewer are left.
var TokenBucket = &Algorithm{
	Name:     "token_bucket",
	NewState: func() State { return &TokenBucketState{Fresh: true} },
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

// TokenBucketState is the tokens left (× Period) at the last admitted call.
type TokenBucketState struct {
	Fresh  bool  // never admitted anything: the bucket is full
	Tokens int64 // tokens × Period
	Last   int64 // µs
}

// Step implements State; it mirrors lua/token_bucket.lua.
func (s *TokenBucketState) Step(p Params, now, n int64) Result {
	capacity, cost := p.Burst*p.Period, n*p.Period
	tokens, last := capacity, now
	if !s.Fresh {
		tokens, last = min(capacity, s.Tokens), s.Last
	}
	// A clock that stepped back refills nothing and does not move Last back;
	// then the refill starts `ahead` µs from now.
	if now > last {
		if elapsed := now - last; elapsed >= ceilDiv(capacity-tokens, p.Limit) {
			tokens = capacity
		} else {
			tokens += elapsed * p.Limit
		}
		last = now
	}
	ahead := last - now
	if tokens < cost {
		return Result{
			Remaining:  floorDiv(tokens, p.Period),
			RetryAfter: ahead + ceilDiv(cost-tokens, p.Limit),
			ResetAfter: ahead + ceilDiv(capacity-tokens, p.Limit),
		}
	}
	s.Fresh, s.Tokens, s.Last = false, tokens-cost, last
	return Result{Allowed: true, Remaining: floorDiv(s.Tokens, p.Period), ResetAfter: ahead + ceilDiv(capacity-s.Tokens, p.Limit)}
}

// LeakyBucketState is the level (× Period) at the last admitted call.
type LeakyBucketState struct {
	Level int64 // events × Period
	Last  int64 // µs
}

// Step implements State; it mirrors lua/leaky_bucket.lua.
func (s *LeakyBucketState) Step(p Params, now, n int64) Result {
	capacity, cost := p.Burst*p.Period, n*p.Period
	level, last := s.Level, s.Last
	if level == 0 {
		last = now
	}
	// A clock that stepped back leaks nothing and does not move Last back;
	// then the leak starts `ahead` µs from now.
	if now > last {
		if elapsed := now - last; elapsed >= ceilDiv(level, p.Limit) {
			level = 0
		} else {
			level -= elapsed * p.Limit
		}
		last = now
	}
	ahead := last - now
	if level+cost > capacity {
		return Result{
			Remaining:  floorDiv(max(0, capacity-level), p.Period),
			RetryAfter: ahead + ceilDiv(level+cost-capacity, p.Limit),
			ResetAfter: ahead + ceilDiv(level, p.Limit),
		}
	}
	s.Level, s.Last = level+cost, last
	return Result{Allowed: true, Remaining: floorDiv(capacity-s.Level, p.Period), ResetAfter: ahead + ceilDiv(s.Level, p.Limit)}
}
