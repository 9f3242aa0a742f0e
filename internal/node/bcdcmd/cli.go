// Package bcdcmd is bcd's command line: `bcd join` (R4, R11.2–R11.4), `bcd
// run`, `bcd renew`, `bcd status`, `bcd doctor`, `bcd fake-machine` (a
// made-up machine's sysfs tree, for trying joins) and `bcd version`. It parses flags, reads the token from where
// R11.2 allows, and prints; the work is in internal/node/enroll and the
// packages under it. Errors print as "Error: CODE: message" with exit
// code 1 (bcd run exits 3 when the node was retired: ExitRetired).
package bcdcmd

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"

	"github.com/better-compute/better-compute/internal/node/cmdline"

	"github.com/better-compute/better-compute/internal/node/enroll"
	"github.com/better-compute/better-compute/internal/shared/clock"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/telemetry"
	"github.com/better-compute/better-compute/internal/shared/version"
)

// Env is the process environment bcd runs in, injected for tests. Zero
// fields mean the real process's.
type Env struct {
	Stdin  io.Reader
	Stdout io.Writer
	Stderr io.Writer
	// LookupEnv and Unsetenv reach the environment (BCD_JOIN_TOKEN).
	LookupEnv func(string) (string, bool)
	Unsetenv  func(string) error
	// StdinIsTerminal reports whether Stdin is a terminal (then no token is
	// read from it); nil checks Stdin when it is an *os.File.
	StdinIsTerminal func() bool
	Clock           clock.Clock
	// HTTPClient makes the join's HTTP clients; nil: enroll.DefaultHTTPClient.
	HTTPClient enroll.HTTPClientFunc
	// DiagReady, when set, receives the address bcd run's diagnostics
	// listener serves on (tests listen on port 0).
	DiagReady func(addr string)
}

func (e *Env) fill() {
	if e.Stdin == nil {
		e.Stdin = os.Stdin
	}
	if e.Stdout == nil {
		e.Stdout = os.Stdout
	}
	if e.Stderr == nil {
		e.Stderr = os.Stderr
	}
	if e.LookupEnv == nil {
		e.LookupEnv = os.LookupEnv
	}
	if e.Unsetenv == nil {
		e.Unsetenv = os.Unsetenv
	}
	if e.StdinIsTerminal == nil {
		in := e.Stdin
		e.StdinIsTerminal = func() bool { return isTerminal(in) }
	}
	if e.Clock == nil {
		e.Clock = clock.Real{}
	}
	if e.HTTPClient == nil {
		e.HTTPClient = enroll.DefaultHTTPClient
	}
}

// isTerminal reports whether r is a character device: a terminal, or
// /dev/null, neither of which carries a token. Pipes and files are input.
func isTerminal(r io.Reader) bool {
	f, ok := r.(*os.File)
	if !ok {
		return false
	}
	st, err := f.Stat()
	return err == nil && st.Mode()&os.ModeCharDevice != 0
}

type app struct {
	env Env
	log *slog.Logger
	// started is set once a command's RunE begins, so an error before it
	// (a bad flag, an unknown command) is reported as INVALID_ARGUMENT.
	started bool
}

// Main runs bcd with args (without the program name) and returns the exit
// code.
func Main(ctx context.Context, args []string, env Env) int {
	env.fill()
	a := &app{env: env}
	// The one-shot commands' log: warnings, without times, with a traced
	// call's trace id (telemetry.Traced) like every process's.
	a.log = slog.New(telemetry.Traced(slog.NewTextHandler(env.Stderr, &slog.HandlerOptions{
		Level: slog.LevelWarn,
		ReplaceAttr: func(groups []string, attr slog.Attr) slog.Attr {
			if len(groups) == 0 && attr.Key == slog.TimeKey {
				return slog.Attr{}
			}
			return attr
		},
	})))
	if err := a.rootCmd().Execute(ctx, args, env.Stdout); err != nil {
		var exit *exitError
		if errors.As(err, &exit) {
			return exit.code
		}
		if _, ok := errs.As(err); !ok && !a.started {
			err = errs.Wrap(err, errs.InvalidArgument, "%v", err)
		}
		fmt.Fprintf(env.Stderr, "Error: %s\n", errorLine(err))
		return 1
	}
	return 0
}

// errorLine is "CODE: message" for any error, the code found through the
// wrapping and not repeated.
func errorLine(err error) string {
	code := errs.CodeOf(err)
	msg := err.Error()
	if e, ok := errs.As(err); ok {
		msg = strings.Replace(msg, e.Error(), e.Message, 1)
	}
	return string(code) + ": " + msg
}

// exitError ends bcd with a code and no message (the command printed what
// it had to say), as `bcd status` does on a machine that has not joined.
type exitError struct{ code int }

func (e *exitError) Error() string { return fmt.Sprintf("exit %d", e.code) }

func (a *app) rootCmd() *cmdline.Command {
	root := &cmdline.Command{
		Use:   "bcd",
		Short: "The better-compute node daemon",
		Long: `bcd makes this machine a node of a better-compute fleet.

Join with a join token on standard input:

  bcd join --config /etc/bcd/config.toml < join-token

then check the identity with 'bcd status'.`,
		Version: version.Version,
		PersistentPreRun: func(*cmdline.Command, []string) {
			a.started = true
		},
	}
	root.AddCommand(a.joinCmd(), a.runCmd(), a.renewCmd(), a.statusCmd(), a.doctorCmd(), a.fakeMachineCmd(), a.siteCmd(), a.versionCmd())
	return root
}

func (a *app) versionCmd() *cmdline.Command {
	return &cmdline.Command{
		Use:   "version",
		Short: "Print bcd's version and the agent protocol it speaks",
		Args:  noArgs,
		RunE: func(*cmdline.Command, []string) error {
			p := fmt.Sprint(version.ProtocolMax)
			if version.ProtocolMin != version.ProtocolMax {
				p = fmt.Sprintf("%d..%d", version.ProtocolMin, version.ProtocolMax)
			}
			fmt.Fprintf(a.env.Stdout, "bcd %s (agent protocol %s)\n", version.Version, p)
			return nil
		},
	}
}

// noArgs refuses positional arguments with a product error.
func noArgs(cmd *cmdline.Command, args []string) error {
	if len(args) > 0 {
		return errs.New(errs.InvalidArgument, "%s takes no arguments", cmd.CommandPath())
	}
	return nil
}
