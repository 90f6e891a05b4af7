package jobs

import (
	"strings"
	"testing"
)

// TestGateName: a gate's name reads back as it was written, whatever its
// name holds (a concurrency slot's label has a colon of its own), and a
// name of no known kind, or with no kind, is refused naming the problem.
func TestGateName(t *testing.T) {
	for _, g := range []GateName{{DrainGate, "emails"}, {FairGate, "Bulk.Import"}, {QuotaGate, "crm-api"}, {ConcurrencyGate, "type:crm:sync"}} {
		got, err := ParseGateName(g.String())
		if err != nil || got != g {
			t.Errorf("ParseGateName(%q) = %+v, %v; want %+v", g.String(), got, err, g)
		}
	}
	for s, want := range map[string]string{
		"emails":       "want KIND:NAME",
		"drain:":       "want KIND:NAME",
		"queue:emails": `the kinds are drain, fair, quota and concurrency, got "queue"`,
	} {
		if _, err := ParseGateName(s); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("ParseGateName(%q) = %v, want an error saying %q", s, err, want)
		}
	}
}
