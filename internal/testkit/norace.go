//go:build !race

package testkit

// RaceEnabled reports whether the race detector is on: tests that do much
// work may do less then (it runs Go code 5 to 10 times slower).
const RaceEnabled = false
