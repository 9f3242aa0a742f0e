// usage.go gives cobra's own usage errors (an unknown flag or command, a
// wrong number of arguments) the product's INVALID_ARGUMENT code, so every
// error the CLI prints has the "Error: CODE: message" form.

package cli

import (
	"errors"
	"strings"

	"github.com/spf13/cobra"

	"github.com/better-compute/better-compute/internal/shared/errs"
)

// codeUsageErrors makes root's and every subcommand's argument and flag
// errors errs.InvalidArgument. Call it once the command tree is built.
func codeUsageErrors(root *cobra.Command) {
	root.SetFlagErrorFunc(func(_ *cobra.Command, err error) error {
		return errs.Invalid("flags", "%v", err)
	})
	var walk func(c *cobra.Command)
	walk = func(c *cobra.Command) {
		if c.Args != nil {
			args := c.Args
			c.Args = func(cmd *cobra.Command, a []string) error {
				if err := args(cmd, a); err != nil {
					var e *errs.E
					if errors.As(err, &e) {
						return err
					}
					return errs.Invalid("arguments", "%v (see %s --help)", err, cmd.CommandPath())
				}
				return nil
			}
		}
		for _, sub := range c.Commands() {
			walk(sub)
		}
	}
	walk(root)
}

// coded returns err as a product error: cobra's "unknown command" becomes
// INVALID_ARGUMENT; anything else is returned as it is.
func coded(err error) error {
	var e *errs.E
	if errors.As(err, &e) {
		return err
	}
	if strings.HasPrefix(err.Error(), "unknown command") || strings.HasPrefix(err.Error(), "unknown flag") || strings.HasPrefix(err.Error(), "unknown shorthand flag") {
		return errs.Invalid("arguments", "%v", err)
	}
	return err
}

// asFlag rewrites an INVALID_ARGUMENT about an API field (expect.mac,
// hosted, ttlSeconds) to name the flag of cmd that set it (--expect-mac,
// --hosted, --ttl-seconds), when cmd has one: a person typed the flag, not
// the field.
func asFlag(cmd *cobra.Command, err error) error {
	var e *errs.E
	if cmd == nil || !errors.As(err, &e) || e.Field == "" || !strings.HasPrefix(e.Message, e.Field+": ") {
		return err
	}
	name := kebab(e.Field)
	if cmd.Flags().Lookup(name) == nil {
		return err
	}
	c := *e
	c.Message = "--" + name + ": " + strings.TrimPrefix(e.Message, e.Field+": ")
	return &c
}

// kebab turns a field path (expect.mac, ttlSeconds) into a flag name
// (expect-mac, ttl-seconds).
func kebab(field string) string {
	var b strings.Builder
	for i, r := range field {
		switch {
		case r == '.' || r == '_':
			b.WriteByte('-')
		case r >= 'A' && r <= 'Z':
			if i > 0 {
				b.WriteByte('-')
			}
			b.WriteRune(r + ('a' - 'A'))
		default:
			b.WriteRune(r)
		}
	}
	return b.String()
}
