// Package cmdtree holds what the better-compute CLI needs of its cobra
// command tree (bcd has its own, internal/node/cmdline, without cobra).
// It imports no process's code.
package cmdtree

import (
	"fmt"
	"strconv"
	"strings"

	"github.com/spf13/cobra"

	"github.com/better-compute/better-compute/internal/shared/errs"
)

// GuardGroups makes every command group below root (a command with
// subcommands and nothing to run itself) refuse an unknown subcommand:
// cobra prints a group's help and exits 0 for `nodes lst`, so a typo in a
// script passes silently; and with flags it blames a valid flag of the
// subcommand meant (`unknown flag: --tenant`). A group now ignores flags
// it does not know and answers INVALID_ARGUMENT "unknown command", with
// the nearest subcommand when one is close. Call it once the tree is built.
func GuardGroups(root *cobra.Command) {
	for _, c := range root.Commands() {
		guard(c)
	}
}

func guard(c *cobra.Command) {
	if c.HasSubCommands() && !c.Runnable() {
		c.Args = cobra.ArbitraryArgs
		c.FParseErrWhitelist.UnknownFlags = true
		c.RunE = func(cmd *cobra.Command, args []string) error {
			if len(args) == 0 {
				return cmd.Help()
			}
			return Unknown(cmd, args[0])
		}
	}
	for _, sub := range c.Commands() {
		guard(sub)
	}
}

// Unknown is the refusal of an unknown subcommand of cmd, naming the
// nearest ones (cobra's suggestions) and the help that lists them all.
func Unknown(cmd *cobra.Command, typed string) error {
	msg := fmt.Sprintf("unknown command %q for %q", typed, cmd.CommandPath())
	// The nearest first: one edit away, else two.
	var s []string
	for d := 1; d <= 2 && len(s) == 0; d++ {
		cmd.SuggestionsMinimumDistance = d
		s = cmd.SuggestionsFor(typed)
	}
	if len(s) > 0 {
		q := make([]string, len(s))
		for i, name := range s {
			q[i] = strconv.Quote(name)
		}
		msg += "; did you mean " + strings.Join(q, " or ") + "?"
	}
	return errs.Invalid("arguments", "%s (see %s --help)", msg, cmd.CommandPath())
}
