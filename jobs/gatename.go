package jobs

import (
	"fmt"
	"strings"
)

// GateKind is what a gate limits.
type GateKind string

const (
	DrainGate       GateKind = "drain"       // a queue's pace
	FairGate        GateKind = "fair"        // a queue's fair shares of its drain
	QuotaGate       GateKind = "quota"       // an API's quota, shared by task types
	ConcurrencyGate GateKind = "concurrency" // slots of a queue or a task type
)

// GateName names a gate: its kind and what it limits (a queue, a quota, a
// concurrency slot's label). Its String, "drain:emails", is the gate's
// label in metrics and logs and the name the CLI takes.
type GateName struct {
	Kind GateKind
	Name string
}

func (g GateName) String() string { return string(g.Kind) + ":" + g.Name }

// ParseGateName reads a gate's name as String writes it.
func ParseGateName(s string) (GateName, error) {
	kind, name, ok := strings.Cut(s, ":")
	g := GateName{Kind: GateKind(kind), Name: name}
	switch {
	case !ok || name == "":
		return GateName{}, fmt.Errorf("gate %q: want KIND:NAME, like drain:emails or quota:crm-api", s)
	case g.Kind != DrainGate && g.Kind != FairGate && g.Kind != QuotaGate && g.Kind != ConcurrencyGate:
		return GateName{}, fmt.Errorf("gate %q: the kinds are drain, fair, quota and concurrency, got %q", s, kind)
	}
	return g, nil
}
