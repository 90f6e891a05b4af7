package throttle_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/algorithms"
	"github.com/sluicehq/sluice/internal/redistest"
	"github.com/sluicehq/sluice/internal/testkit"
	"github.com/sluicehq/sluice/throttle"
)

// randomSpec draws a spec of algorithm a small enough to hit its limits often.
func randomSpec(rng *rand.Rand, a throttle.Algorithm) throttle.Spec {
	periods := []time.Duration{time.Millisecond, 7 * time.Millisecond, 100 * time.Millisecond, time.Second, 3 * time.Second, time.Minute}
	spec := throttle.Spec{Algorithm: a, Limit: 1 + rng.IntN(12), Period: periods[rng.IntN(len(periods))]}
	if rng.IntN(2) == 0 {
		spec.Burst = 1 + rng.IntN(12)
	}
	if a == throttle.SlidingCounter {
		// Sub-windows must be whole microseconds.
		divisors := []int{1, 2, 4, 5, 8, 10}
		spec.Windows = divisors[rng.IntN(len(divisors))]
	}
	return spec
}

func capacityOf(spec throttle.Spec) int {
	switch spec.Algorithm {
	case throttle.TokenBucket, throttle.LeakyBucket:
		if spec.Burst > 0 {
			return spec.Burst
		}
	}
	return spec.Limit
}

// privateEngines are the Redis engines of engines(t) on servers of the
// test's own, a standalone server and a cluster: a test that flushes the
// scripts and functions of the shared servers makes every package's tests
// running beside it load theirs again, a stall that timing tests feel.
func privateEngines(t *testing.T) []engine {
	srv := redistest.StartServer(t, "--appendonly", "no")
	standalone := redis.NewClient(&redis.Options{Addr: srv.Addr})
	scripts := redis.NewClient(&redis.Options{Addr: srv.Addr})
	algorithms.BookScript.ScriptsOnly(scripts)
	cluster := redistest.StartCluster(t).Client(t)
	t.Cleanup(func() { standalone.Close(); scripts.Close() })
	return []engine{{name: "redis", rdb: standalone}, {name: "redis-evalsha", rdb: scripts}, {name: "cluster", rdb: cluster}}
}

// flushScripts empties the script cache and the functions of every server
// rdb talks to.
func flushScripts(ctx context.Context, rdb redis.UniversalClient) error {
	flush := func(ctx context.Context, c *redis.Client) error {
		if err := c.ScriptFlush(ctx).Err(); err != nil {
			return err
		}
		err := c.FunctionFlush(ctx).Err()
		if err != nil && strings.Contains(err.Error(), "unknown command") {
			return nil // miniredis: no functions to flush
		}
		return err
	}
	if c, ok := rdb.(*redis.ClusterClient); ok {
		return c.ForEachMaster(ctx, flush)
	}
	return flush(ctx, rdb.(*redis.Client))
}

// TestRedisMatchesLocal runs seeded random timelines through a Redis engine
// and the local engine side by side: every decision and reservation must be
// the same. The timelines mix AllowN, ReserveAfter, Cancel, Block and Peek on several keys,
// with costs up to the capacity, instants that repeat, and a clock that
// sometimes steps back. Every 50 calls the Redis script cache and functions are flushed,
// which must cost no decision. The events admitted, reserved and not
// cancelled must never exceed the limit (conforms).
func TestRedisMatchesLocal(t *testing.T) {
	ctx := context.Background()
	mini := redis.NewClient(&redis.Options{Addr: miniredis.RunT(t).Addr(), ReadTimeout: time.Minute})
	t.Cleanup(func() { mini.Close() })
	// miniredis (Redis 6's path: scripts, no functions) beside the servers,
	// for the buckets: the windowed algorithms' timelines do not finish on
	// miniredis (they did not before the buckets' lean script either).
	for _, e := range append(privateEngines(t), engine{name: "miniredis", rdb: mini}) {
		for _, a := range throttle.Algorithms {
			if e.name == "miniredis" && a != throttle.TokenBucket && a != throttle.LeakyBucket {
				continue
			}
			t.Run(e.name+"/"+string(a), func(t *testing.T) {
				for seed := uint64(1); seed <= 12; seed++ {
					rng := rand.New(rand.NewPCG(seed, uint64(len(a))))
					spec := randomSpec(rng, a)
					clock := testkit.NewClock(t0.Add(time.Duration(rng.Int64N(int64(time.Hour)))))
					prefix := redistest.Prefix(t)
					remote, err := throttle.New(e.rdb, spec, throttle.WithClock(clock), throttle.WithPrefix(prefix))
					if err != nil {
						t.Fatal(err)
					}
					local, err := throttle.NewLocal(spec, throttle.WithClock(clock))
					if err != nil {
						t.Fatal(err)
					}
					engines := []throttle.Reserver{local, remote}
					keys := []string{"a", "b{c}", "user:42"}
					// Odd seeds let the clock step back now and then. Limits hold
					// only for a clock that does not: what was forgotten as
					// expired cannot be counted again.
					stepsBack := seed%2 == 1
					events := map[string][]event{}
					reserved := map[string][]throttle.Reservation{}
					fail := func(i int, format string, args ...any) {
						t.Helper()
						t.Fatalf("seed %d, spec %+v, call %d at %d: %s", seed, spec, i, clock.Now().UnixMicro(), fmt.Sprintf(format, args...))
					}
					for i := 0; i < 250; i++ {
						if i%50 == 25 {
							if err := flushScripts(ctx, e.rdb); err != nil {
								t.Fatal(err)
							}
						}
						switch r := rng.IntN(20); {
						case r == 0 && stepsBack: // the clock steps back
							clock.Set(clock.Now().Add(-time.Duration(rng.Int64N(int64(spec.Period)))))
						case r < 5: // the same instant again
						default:
							clock.Set(clock.Now().Add(time.Duration(rng.Int64N(int64(spec.Period) / int64(spec.Limit)))))
						}
						key, n := keys[rng.IntN(len(keys))], 1+rng.IntN(capacityOf(spec))
						switch op := rng.IntN(10); {
						case op < 6:
							var got [2]throttle.Decision
							for j, lim := range engines {
								if got[j], err = lim.AllowN(ctx, key, n); err != nil {
									fail(i, "AllowN: %v", err)
								}
							}
							if got[0] != got[1] {
								fail(i, "AllowN(%q, %d): local %+v, redis %+v", key, n, got[0], got[1])
							}
							if got[0].Allowed {
								events[key] = append(events[key], event{clock.Now().UnixMicro(), n})
							}
						case op < 9:
							maxWait := time.Duration(rng.Int64N(2 * int64(spec.Period)))
							var notBefore time.Time
							if rng.IntN(3) == 0 {
								notBefore = clock.Now().Add(time.Duration(rng.Int64N(int64(spec.Period))))
							}
							var got [2]throttle.Reservation
							for j, lim := range engines {
								if got[j], err = lim.ReserveAfter(ctx, key, n, notBefore, maxWait); err != nil {
									fail(i, "ReserveAfter: %v", err)
								}
							}
							if got[0] != got[1] {
								fail(i, "ReserveN(%q, %d, %v): local %+v, redis %+v", key, n, maxWait, got[0], got[1])
							}
							if got[0].OK {
								if want := time.UnixMicro(clock.Now().UnixMicro()).Add(got[0].Delay); !got[0].At.Equal(want) {
									fail(i, "reservation at %v, want now + Delay = %v", got[0].At, want)
								}
								if got[0].At.Before(notBefore.Truncate(time.Microsecond)) {
									fail(i, "reservation at %v, before notBefore %v", got[0].At, notBefore)
								}
								events[key] = append(events[key], event{got[0].At.UnixMicro(), n})
								reserved[key] = append(reserved[key], got[0])
							} else if got[0].Delay <= maxWait {
								fail(i, "reservation refused with Delay %v <= maxWait %v", got[0].Delay, maxWait)
							}
						case op == 9 && rng.IntN(4) == 1:
							var got [2]throttle.Level
							for j, lim := range engines {
								if got[j], err = lim.Peek(ctx, key); err != nil {
									fail(i, "Peek: %v", err)
								}
							}
							if got[0] != got[1] {
								fail(i, "Peek(%q): local %+v, redis %+v", key, got[0], got[1])
							}
						case op == 9 && rng.IntN(4) == 0:
							d := time.Duration(rng.Int64N(int64(spec.Period)))
							for _, lim := range engines {
								if err := lim.Block(ctx, key, d); err != nil {
									fail(i, "Block: %v", err)
								}
							}
						default:
							if len(reserved[key]) == 0 {
								continue
							}
							k := rng.IntN(len(reserved[key]))
							res := reserved[key][k]
							reserved[key] = append(reserved[key][:k], reserved[key][k+1:]...)
							for _, lim := range engines {
								if err := lim.Cancel(ctx, key, res); err != nil {
									fail(i, "Cancel: %v", err)
								}
							}
							events[key] = removeEvent(events[key], event{res.At.UnixMicro(), res.N})
						}
					}
					for key, evs := range events {
						if stepsBack {
							break
						}
						if err := conforms(spec, evs); err != nil {
							t.Fatalf("seed %d, spec %+v, key %q: %v", seed, spec, key, err)
						}
					}
					assertAllKeysExpire(t, e.rdb, prefix)
				}
			})
		}
	}
}

// assertAllKeysExpire checks that every key under prefix has a TTL.
func assertAllKeysExpire(t *testing.T, rdb redis.UniversalClient, prefix string) {
	t.Helper()
	ctx := context.Background()
	check := func(ctx context.Context, c *redis.Client) error {
		iter := c.Scan(ctx, 0, prefix+"*", 100).Iterator()
		for iter.Next(ctx) {
			ttl, err := c.PTTL(ctx, iter.Val()).Result()
			if err != nil {
				return err
			}
			if ttl < 0 {
				return fmt.Errorf("key %q has no TTL (PTTL %v)", iter.Val(), ttl)
			}
		}
		return iter.Err()
	}
	var err error
	switch c := rdb.(type) {
	case *redis.ClusterClient:
		err = c.ForEachMaster(ctx, check)
	case *redis.Client:
		err = check(ctx, c)
	}
	if err != nil {
		t.Fatal(err)
	}
}

// TestBookTwoBucketsMatchesLocal runs seeded random timelines of Books on a
// drain and a quota (two buckets on one hash tag: the library's
// book_buckets function on Redis 7, the book script elsewhere) through each
// Redis engine and the local engine side by side: every booking must be the
// same. Cancels leave a bucket two spans and Blocks a block, states the
// quick steps do not read, so the timelines cross from the quick path to
// book.lua and back.
func TestBookTwoBucketsMatchesLocal(t *testing.T) {
	ctx := context.Background()
	for _, e := range engines(t)[1:] {
		t.Run(e.name, func(t *testing.T) {
			var booked, refused, slowStates int
			for seed := uint64(1); seed <= 16; seed++ {
				rng := rand.New(rand.NewPCG(seed, 25))
				buckets := []throttle.Algorithm{throttle.TokenBucket, throttle.LeakyBucket}
				specs := [2]throttle.Spec{randomSpec(rng, buckets[rng.IntN(2)]), randomSpec(rng, buckets[rng.IntN(2)])}
				clock := testkit.NewClock(t0.Add(time.Duration(rng.Int64N(int64(time.Hour)))))
				prefix := redistest.Prefix(t)
				var remote, local [2]throttle.Reserver
				for i, spec := range specs {
					var err error
					if remote[i], err = throttle.New(e.rdb, spec, throttle.WithClock(clock), throttle.WithPrefix(fmt.Sprintf("%s%d:", prefix, i))); err != nil {
						t.Fatal(err)
					}
					if local[i], err = throttle.NewLocal(spec, throttle.WithClock(clock)); err != nil {
						t.Fatal(err)
					}
				}
				type turn struct {
					claim int
					r     [2]throttle.Reservation // the local's, the remote's
				}
				var turns []turn // booked, not cancelled
				fail := func(i int, format string, args ...any) {
					t.Helper()
					t.Fatalf("seed %d, specs %+v, call %d: %s", seed, specs, i, fmt.Sprintf(format, args...))
				}
				for i := 0; i < 150; i++ {
					if rng.IntN(4) > 0 {
						clock.Set(clock.Now().Add(time.Duration(rng.Int64N(int64(specs[0].Period) / int64(specs[0].Limit)))))
					}
					switch op := rng.IntN(20); {
					case op < 14:
						n := [2]int{1 + rng.IntN(capacityOf(specs[0])), 1 + rng.IntN(capacityOf(specs[1]))}
						maxWait := time.Duration(rng.Int64N(2 * int64(specs[0].Period)))
						var notBefore time.Time
						if rng.IntN(3) == 0 {
							notBefore = clock.Now().Add(time.Duration(rng.Int64N(int64(specs[0].Period))))
						}
						var got [2]throttle.Booking
						for j, lims := range [][2]throttle.Reserver{local, remote} {
							claims := []throttle.Claim{{Limiter: lims[0], Key: "q", N: n[0]}, {Limiter: lims[1], Key: "q", N: n[1]}}
							var err error
							if got[j], err = throttle.Book(ctx, claims, notBefore, maxWait); err != nil {
								fail(i, "Book: %v", err)
							}
						}
						if !reflect.DeepEqual(got[0], got[1]) {
							fail(i, "Book(%v, notBefore %v, maxWait %v): local %+v, redis %+v", n, notBefore, maxWait, got[0], got[1])
						}
						if got[0].OK {
							booked++
							for k := range 2 {
								turns = append(turns, turn{k, [2]throttle.Reservation{got[0].Turns[k], got[1].Turns[k]}})
							}
						} else {
							refused++
						}
					case op < 18 && len(turns) > 0:
						k := rng.IntN(len(turns))
						for j, lims := range [][2]throttle.Reserver{local, remote} {
							if err := lims[turns[k].claim].Cancel(ctx, "q", turns[k].r[j]); err != nil {
								fail(i, "Cancel: %v", err)
							}
						}
						turns = append(turns[:k], turns[k+1:]...) // given back once
						slowStates++
					case op >= 18:
						d := time.Duration(rng.Int64N(int64(specs[1].Period)))
						which := rng.IntN(2)
						for _, lims := range [][2]throttle.Reserver{local, remote} {
							if err := lims[which].Block(ctx, "q", d); err != nil {
								fail(i, "Block: %v", err)
							}
						}
						slowStates++
					}
				}
			}
			if booked < 200 || refused < 50 || slowStates < 100 {
				t.Fatalf("%d booked, %d refused, %d cancels and blocks: the timelines test too little", booked, refused, slowStates)
			}
		})
	}
}
