package jobs

import (
	"encoding/json"

	"github.com/sluicehq/sluice/throttle"
)

// Task headers through which a task carries what the gates gave it across
// a trip back to Redis. A requeued task is a copy with a new id (asynq does
// not let a task be re-enqueued under the id of one that still exists).
const (
	headerTurns  = "sluice-turns"  // the turns booked, JSON []heldTurn
	headerOrigin = "sluice-origin" // the id of the task as first enqueued
	headerHop    = "sluice-hop"    // how many times it went back to Redis
)

// maxTurnsHeader bounds the turns header: it comes from whoever enqueued
// the task, and is read before anything else.
const maxTurnsHeader = 64 << 10

// heldTurn is the turn one gate (its tag: name@version of its limit) gave
// a task: its instant on the limiter's clock, and what giving it back
// gives back.
type heldTurn struct {
	Gate string               `json:"gate"`
	Turn throttle.Reservation `json:"turn"`
}

// readTurns returns the turns a task carries, by gate. A header that does
// not parse is ignored: the task then books its turns anew, which costs
// capacity but never exceeds a limit.
func readTurns(headers map[string]string) map[string]heldTurn {
	raw := headers[headerTurns]
	if raw == "" || len(raw) > maxTurnsHeader {
		return nil
	}
	var turns []heldTurn
	if err := json.Unmarshal([]byte(raw), &turns); err != nil {
		return nil
	}
	byGate := make(map[string]heldTurn, len(turns))
	for _, t := range turns {
		if t.Gate != "" && t.Turn.OK {
			byGate[t.Gate] = t
		}
	}
	return byGate
}

func writeTurns(turns []heldTurn) string {
	b, _ := json.Marshal(turns) // OK reservations always marshal
	return string(b)
}
