// Package cli is what sluice's commands (worker, enqueue) share so that
// they behave alike: cobra set up the same way (errors printed once,
// --version from the build information, shell completion, bad flags as
// bad input), and exit codes carried by errors.
package cli

import (
	"context"
	"errors"
	"fmt"
	"io"

	"github.com/spf13/cobra"

	"github.com/sluicehq/sluice/internal/version"
)

// ExitBadInput is the exit code of bad arguments, input or config, and of
// any error that does not say otherwise (cobra's own checks of flags and
// arguments among them).
const ExitBadInput = 2

// ExitError is an error with the exit code it calls for.
type ExitError struct {
	Code int
	Err  error
}

// Error is the error's message, without the code.
func (e *ExitError) Error() string { return e.Err.Error() }

// Unwrap returns the error, for errors.Is and errors.As.
func (e *ExitError) Unwrap() error { return e.Err }

// BadInput marks err as the user's to fix.
func BadInput(err error) error { return &ExitError{ExitBadInput, err} }

// Setup makes root behave as every sluice command does: errors are left to
// Execute to print, --version prints version.String(), a bad flag is bad
// input that points to --help, and `completion` writes the shell
// completion script (cobra's default command).
func Setup(root *cobra.Command) {
	root.SilenceErrors = true
	root.SilenceUsage = true
	root.Version = version.String()
	root.SetVersionTemplate("{{.Version}}\n")
	root.SetFlagErrorFunc(func(cmd *cobra.Command, err error) error {
		return BadInput(fmt.Errorf("%w (see %s --help)", err, cmd.CommandPath()))
	})
}

// Execute runs root on args and returns the exit code: 0, or the code of
// the error's ExitError (ExitBadInput if it has none) once report has
// printed it to stderr.
func Execute(ctx context.Context, root *cobra.Command, args []string, stdin io.Reader, stdout, stderr io.Writer, report func(stderr io.Writer, err error)) int {
	root.SetArgs(args)
	root.SetIn(stdin)
	root.SetOut(stdout)
	root.SetErr(stderr)
	err := root.ExecuteContext(ctx)
	if err == nil {
		return 0
	}
	report(stderr, err)
	var e *ExitError
	if errors.As(err, &e) {
		return e.Code
	}
	return ExitBadInput
}
