package jobs

import (
	"encoding/json"
	"time"
)

// Task headers through which a task carries what the gates gave it across
// a trip back to Redis. A requeued task is a copy with a new id (asynq does
// not let a task be re-enqueued under the id of one that still exists).
const (
	headerTurns  = "sluice-turns"  // the turns booked, JSON []heldTurn
	headerOrigin = "sluice-origin" // the id of the task as first enqueued
	headerHop    = "sluice-hop"    // how many times it went back to Redis
)

// heldTurn is a turn booked by one gate (its tag: name@version of its
// limit): n events counted at At (µs on the limiter's clock, Redis's).
type heldTurn struct {
	Gate string `json:"gate"`
	At   int64  `json:"at"`
	N    int    `json:"n"`
}

// readTurns returns the turns a task carries, by gate. A header that does
// not parse is ignored: the task then books its turns anew, which costs
// capacity but never exceeds a limit.
func readTurns(headers map[string]string) map[string]heldTurn {
	raw := headers[headerTurns]
	if raw == "" {
		return nil
	}
	var turns []heldTurn
	if err := json.Unmarshal([]byte(raw), &turns); err != nil {
		return nil
	}
	byGate := make(map[string]heldTurn, len(turns))
	for _, t := range turns {
		if t.Gate != "" && t.N > 0 {
			byGate[t.Gate] = t
		}
	}
	return byGate
}

func writeTurns(turns []heldTurn) string {
	b, _ := json.Marshal(turns) // a slice of plain structs always marshals
	return string(b)
}

func (t heldTurn) at() time.Time { return time.UnixMicro(t.At) }
