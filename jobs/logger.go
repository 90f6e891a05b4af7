package jobs

import (
	"fmt"
	"log/slog"
	"strings"
)

// asynqLogger sends asynq's log lines to slog.
type asynqLogger struct{ log *slog.Logger }

func (l asynqLogger) Debug(args ...any) { l.log.Debug(fmt.Sprint(args...), "from", "asynq") }
func (l asynqLogger) Info(args ...any)  { l.log.Info(fmt.Sprint(args...), "from", "asynq") }
func (l asynqLogger) Error(args ...any) { l.log.Error(fmt.Sprint(args...), "from", "asynq") }
func (l asynqLogger) Fatal(args ...any) { l.log.Error(fmt.Sprint(args...), "from", "asynq") }

func (l asynqLogger) Warn(args ...any) {
	msg := fmt.Sprint(args...)
	// asynq warns of every revoked task; the scheduler revokes each task it
	// requeues for its turn, which is routine, not a warning.
	if strings.HasPrefix(msg, "revoke task") {
		l.log.Debug(msg, "from", "asynq")
		return
	}
	l.log.Warn(msg, "from", "asynq")
}
