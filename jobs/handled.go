package jobs

import (
	"fmt"
	"slices"
	"strings"
)

// HandlerProblem is a mismatch between the task types a worker handles and
// the config's tasks: entries, found by CheckHandled.
type HandlerProblem struct {
	// Key is where config.yaml has (or lacks) the entry: tasks.<type>.
	Key     string
	Problem string
	// Typo: a handled type has no entry while an entry no handler takes
	// has a name near it. The handled type runs with none of the limits
	// meant for it (quotas, cost, concurrency): the worker refuses to
	// start, and a reload is refused.
	Typo bool
}

func (p HandlerProblem) Error() string { return p.Key + ": " + p.Problem }

// maxNameDistance is how many edits apart two task types are near (a typo).
const maxNameDistance = 2

// CheckHandled compares the patterns a worker's asynq.ServeMux handles
// (a type, or a prefix that takes every type it starts, as the mux
// matches them) with cfg's tasks: entries. It reports a tasks: entry that
// no pattern handles, with the handled type nearest to it; and a handled
// type that has no entry while an entry's name is near it (a typo in one
// or the other), which is a Typo. A handled type with no entry and no
// near name is not reported: a type without limits of its own is usual
// (it meets its queue's drain only). An entry no pattern handles may be
// another program's, in a fleet that shares one config: reported, not
// refused.
func CheckHandled(cfg Config, patterns []string) []HandlerProblem {
	handles := func(typ string) bool {
		return slices.ContainsFunc(patterns, func(p string) bool { return strings.HasPrefix(typ, p) })
	}
	var unhandled []string
	for _, typ := range sortedKeys(cfg.Tasks) {
		if !handles(typ) {
			unhandled = append(unhandled, typ)
		}
	}
	var problems []HandlerProblem
	typoOf := map[string]string{} // unhandled entry -> the handled type near it
	for _, p := range slices.Sorted(slices.Values(patterns)) {
		if _, ok := cfg.Tasks[p]; ok || slices.ContainsFunc(sortedKeys(cfg.Tasks), func(typ string) bool { return strings.HasPrefix(typ, p) }) {
			continue
		}
		near, ok := nearest(p, unhandled)
		if !ok {
			continue
		}
		typoOf[near] = p
		problems = append(problems, HandlerProblem{Key: "tasks." + p, Typo: true, Problem: fmt.Sprintf(
			"this worker handles %q, which has no entry under tasks:, so it runs with none of its limits (quotas, cost, concurrency); "+
				"tasks.%s is near it and no handler of this worker takes it: is one of them a typo? (If not, give %[1]q an entry of its own under tasks:, even an empty one.)", p, near)})
	}
	for _, typ := range unhandled {
		if _, typo := typoOf[typ]; typo {
			continue // reported with its handled twin
		}
		problem := fmt.Sprintf("no handler of this worker takes %q (it handles %s)", typ, describeGates(slices.Sorted(slices.Values(patterns))))
		if near, ok := nearest(typ, patterns); ok {
			problem = fmt.Sprintf("no handler of this worker takes %q; the nearest it handles is %q", typ, near)
		}
		problems = append(problems, HandlerProblem{Key: "tasks." + typ, Problem: problem +
			"; its limits apply only if another worker of the fleet handles it"})
	}
	return problems
}

// nearest is the name in names nearest to name, if one is near: at most
// maxNameDistance edits, and fewer than a third of its length (so that
// short names are not all near one another).
func nearest(name string, names []string) (string, bool) {
	best, bestDistance := "", maxNameDistance+1
	for _, n := range names {
		d := editDistance(name, n)
		if d < bestDistance && d*3 < len(name) {
			best, bestDistance = n, d
		}
	}
	return best, best != ""
}

// editDistance is the Levenshtein distance between a and b, in bytes.
func editDistance(a, b string) int {
	prev := make([]int, len(b)+1)
	cur := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			sub := prev[j-1]
			if a[i-1] != b[j-1] {
				sub++
			}
			cur[j] = min(sub, prev[j]+1, cur[j-1]+1)
		}
		prev, cur = cur, prev
	}
	return prev[len(b)]
}
