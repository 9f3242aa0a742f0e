// Package cmdline is bcd's command tree: commands with flags, help and
// usage in cobra's format, and refusals of unknown commands that name the
// nearest ones. bcd used cobra; this is the part of it bcd needs, without
// text/template and cobra's completion machinery, which made half a
// megabyte of every node's binary. The better-compute CLI keeps cobra
// (internal/shared/cmdtree).
package cmdline

import (
	"context"
	"fmt"
	"io"
	"sort"
	"strconv"
	"strings"

	"github.com/better-compute/better-compute/internal/shared/errs"
)

// Command is one command of the tree.
type Command struct {
	// Use is the usage line after the parent's path; its first word is the
	// command's name.
	Use     string
	Short   string
	Long    string
	Example string
	// Version, on the root, adds --version (-v).
	Version string
	// Args checks the positional arguments; nil takes any.
	Args func(cmd *Command, args []string) error
	// RunE runs the command. A command without it lists its subcommands.
	RunE func(cmd *Command, args []string) error
	// PersistentPreRun, on the root, runs before any command's RunE.
	PersistentPreRun func(cmd *Command, args []string)

	parent *Command
	subs   []*Command
	flags  FlagSet
	ctx    context.Context
	out    io.Writer
	help   bool
	ver    bool
}

// AddCommand adds subcommands.
func (c *Command) AddCommand(subs ...*Command) {
	for _, s := range subs {
		s.parent = c
	}
	c.subs = append(c.subs, subs...)
}

// Flags is the command's flags.
func (c *Command) Flags() *FlagSet { return &c.flags }

// Context is the context Execute was given.
func (c *Command) Context() context.Context { return c.root().ctx }

// Name is the first word of Use.
func (c *Command) Name() string {
	name, _, _ := strings.Cut(c.Use, " ")
	return name
}

// CommandPath is the command's name after its parents' ("bcd site vouch").
func (c *Command) CommandPath() string {
	if c.parent == nil {
		return c.Name()
	}
	return c.parent.CommandPath() + " " + c.Name()
}

func (c *Command) root() *Command {
	for c.parent != nil {
		c = c.parent
	}
	return c
}

// sub is the subcommand called name, or nil.
func (c *Command) sub(name string) *Command {
	for _, s := range c.subs {
		if s.Name() == name {
			return s
		}
	}
	return nil
}

// NoArgs refuses positional arguments, as cobra.NoArgs.
func NoArgs(cmd *Command, args []string) error {
	if len(args) > 0 {
		return fmt.Errorf("unknown command %q for %q", args[0], cmd.CommandPath())
	}
	return nil
}

// Execute runs the command args name, under the root c, writing help to
// out. An unknown command or flag is an error, as is what RunE returns.
func (c *Command) Execute(ctx context.Context, args []string, out io.Writer) error {
	c.ctx, c.out = ctx, out
	c.addDefaultFlags()
	cmd, args := c.find(args)
	if cmd == c && len(args) > 0 && args[0] == "help" {
		return c.helpCommand(args[1:])
	}
	rest, err := cmd.flags.parse(args)
	if err != nil {
		if cmd.subs != nil && cmd.RunE == nil && firstWord(args) != "" {
			// A group ignores flags it does not know: the typo is in the
			// command's name, not in a flag of the command meant.
			return cmd.refuse(firstWord(args))
		}
		return err
	}
	if cmd.help {
		return cmd.printHelp()
	}
	if cmd == c && c.ver {
		_, err := fmt.Fprintf(out, "%s version %s\n", c.Name(), c.Version)
		return err
	}
	if cmd.RunE == nil {
		if len(rest) == 0 {
			return cmd.printHelp()
		}
		return cmd.refuse(rest[0])
	}
	if cmd.Args != nil {
		if err := cmd.Args(cmd, rest); err != nil {
			return err
		}
	}
	if pre := c.PersistentPreRun; pre != nil {
		pre(cmd, rest)
	}
	return cmd.RunE(cmd, rest)
}

// firstWord is the first argument that is not a flag, "" without one.
func firstWord(args []string) string {
	for _, a := range args {
		if !strings.HasPrefix(a, "-") {
			return a
		}
	}
	return ""
}

// addDefaultFlags adds --help to every command and --version to the root.
func (c *Command) addDefaultFlags() {
	if c.flags.flags["help"] == nil {
		c.flags.add("help", "h", "help for "+c.Name(), boolValue{&c.help})
	}
	if c.parent == nil && c.Version != "" && c.flags.flags["version"] == nil {
		c.flags.add("version", "v", "version for "+c.Name(), boolValue{&c.ver})
	}
	for _, s := range c.subs {
		s.addDefaultFlags()
	}
}

// find walks args down the tree, as cobra's Find: the first argument that
// is not a flag (nor a known flag's value) names a subcommand, which is
// descended into; the rest of args, flags included, go with it.
func (c *Command) find(args []string) (*Command, []string) {
	cmd := c
	for {
		i := cmd.nameIndex(args)
		if i < 0 {
			return cmd, args
		}
		s := cmd.sub(args[i])
		if s == nil {
			return cmd, args
		}
		cmd, args = s, append(args[:i:i], args[i+1:]...)
	}
}

// nameIndex is the index of the first argument that is neither a flag nor
// the value of one of c's flags given as "--name value"; -1 without one.
func (c *Command) nameIndex(args []string) int {
	for i := 0; i < len(args); i++ {
		a := args[i]
		switch {
		case a == "--":
			return -1
		case strings.HasPrefix(a, "--") && !strings.Contains(a, "="):
			if fl := c.flags.flags[a[2:]]; fl != nil && fl.value.Type() != "bool" {
				i++
			}
		case strings.HasPrefix(a, "-") && len(a) > 1:
		default:
			return i
		}
	}
	return -1
}

// helpCommand is `bcd help [command]`.
func (c *Command) helpCommand(path []string) error {
	cmd, rest := c.find(path)
	if len(rest) > 0 {
		return cmd.refuse(rest[0])
	}
	return cmd.printHelp()
}

// refuse is the error for an unknown subcommand typed under c.
func (c *Command) refuse(typed string) error {
	names := make([]string, 0, len(c.subs)+1)
	for _, s := range c.subs {
		names = append(names, s.Name())
	}
	if c.parent == nil {
		names = append(names, "help")
	}
	return Unknown(c.CommandPath(), typed, names)
}

// Unknown is the refusal of an unknown subcommand typed under path, naming
// the nearest of names (one edit away, else two, or those it begins) and
// the help that lists them all.
func Unknown(path, typed string, names []string) error {
	msg := fmt.Sprintf("unknown command %q for %q", typed, path)
	var near []string
	for d := 1; d <= 2 && len(near) == 0; d++ {
		for _, n := range names {
			if levenshtein(strings.ToLower(typed), strings.ToLower(n)) <= d ||
				typed != "" && strings.HasPrefix(strings.ToLower(n), strings.ToLower(typed)) {
				near = append(near, strconv.Quote(n))
			}
		}
	}
	if len(near) > 0 {
		msg += "; did you mean " + strings.Join(near, " or ") + "?"
	}
	return errs.New(errs.InvalidArgument, "%s (see %s --help)", msg, path)
}

func levenshtein(a, b string) int {
	prev := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur := make([]int, len(b)+1)
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
		}
		prev = cur
	}
	return prev[len(b)]
}

// printHelp writes cobra's help: the long description, then the usage.
func (c *Command) printHelp() error {
	var b strings.Builder
	if text := strings.TrimRight(firstNonEmpty(c.Long, c.Short), " \t\n"); text != "" {
		b.WriteString(text + "\n\n")
	}
	b.WriteString(c.usage())
	_, err := io.WriteString(c.root().out, b.String())
	return err
}

func firstNonEmpty(a, b string) string {
	if a != "" {
		return a
	}
	return b
}

// usage is cobra's default usage template, for what bcd's commands use.
func (c *Command) usage() string {
	var b strings.Builder
	b.WriteString("Usage:")
	if c.RunE != nil {
		line := c.Use
		if c.parent != nil {
			line = c.parent.CommandPath() + " " + c.Use
		}
		if !strings.Contains(line, "[flags]") {
			line += " [flags]"
		}
		b.WriteString("\n  " + line)
	}
	if len(c.subs) > 0 {
		b.WriteString("\n  " + c.CommandPath() + " [command]")
	}
	if c.Example != "" {
		b.WriteString("\n\nExamples:\n" + c.Example)
	}
	if len(c.subs) > 0 {
		b.WriteString("\n\nAvailable Commands:")
		type entry struct{ name, short string }
		entries := make([]entry, 0, len(c.subs)+1)
		for _, s := range c.subs {
			entries = append(entries, entry{s.Name(), s.Short})
		}
		if c.parent == nil {
			entries = append(entries, entry{"help", "Help about any command"})
		}
		sort.Slice(entries, func(i, j int) bool { return entries[i].name < entries[j].name })
		pad := 11
		for _, e := range entries {
			pad = max(pad, len(e.name))
		}
		for _, e := range entries {
			fmt.Fprintf(&b, "\n  %-*s %s", pad, e.name, e.short)
		}
	}
	b.WriteString("\n\nFlags:\n" + strings.TrimRight(c.flags.usages(), " \t\n"))
	if len(c.subs) > 0 {
		fmt.Fprintf(&b, "\n\nUse \"%s [command] --help\" for more information about a command.", c.CommandPath())
	}
	b.WriteString("\n")
	return b.String()
}
