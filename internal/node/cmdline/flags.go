package cmdline

import (
	"fmt"
	"sort"
	"strconv"
	"strings"
)

// value is one flag's value, as pflag's Value.
type value interface {
	Set(string) error
	String() string
	Type() string // "string", "bool", "int", "strings"
}

type stringValue struct{ p *string }

func (v stringValue) Set(s string) error { *v.p = s; return nil }
func (v stringValue) String() string     { return *v.p }
func (v stringValue) Type() string       { return "string" }

type boolValue struct{ p *bool }

func (v boolValue) Set(s string) error {
	b, err := strconv.ParseBool(s)
	if err != nil {
		return err
	}
	*v.p = b
	return nil
}
func (v boolValue) String() string { return strconv.FormatBool(*v.p) }
func (v boolValue) Type() string   { return "bool" }

type int64Value struct{ p *int64 }

func (v int64Value) Set(s string) error {
	n, err := strconv.ParseInt(s, 0, 64)
	if err != nil {
		return err
	}
	*v.p = n
	return nil
}
func (v int64Value) String() string { return strconv.FormatInt(*v.p, 10) }
func (v int64Value) Type() string   { return "int" }

// sliceValue is pflag's StringSlice: comma-separated values, each use
// appending (the first use replaces the default).
type sliceValue struct {
	p       *[]string
	changed bool
}

func (v *sliceValue) Set(s string) error {
	var parts []string
	if s != "" {
		parts = strings.Split(s, ",")
	}
	if !v.changed {
		*v.p = parts
	} else {
		*v.p = append(*v.p, parts...)
	}
	v.changed = true
	return nil
}
func (v *sliceValue) String() string { return "[" + strings.Join(*v.p, ",") + "]" }
func (v *sliceValue) Type() string   { return "strings" }

// flag is one defined flag.
type flag struct {
	name, shorthand, usage, defValue string
	value                            value
	changed                          bool
}

// FlagSet is a command's flags, parsed as pflag does: --name value,
// --name=value, booleans without a value, flags and arguments in any order,
// "--" ending the flags.
type FlagSet struct {
	flags map[string]*flag
	short map[string]*flag
}

func (f *FlagSet) add(name, shorthand, usage string, v value) {
	if f.flags == nil {
		f.flags, f.short = map[string]*flag{}, map[string]*flag{}
	}
	fl := &flag{name: name, shorthand: shorthand, usage: usage, defValue: v.String(), value: v}
	f.flags[name] = fl
	if shorthand != "" {
		f.short[shorthand] = fl
	}
}

// StringVar defines a string flag.
func (f *FlagSet) StringVar(p *string, name, def, usage string) {
	*p = def
	f.add(name, "", usage, stringValue{p})
}

// BoolVar defines a boolean flag.
func (f *FlagSet) BoolVar(p *bool, name string, def bool, usage string) {
	*p = def
	f.add(name, "", usage, boolValue{p})
}

// Int64Var defines an integer flag.
func (f *FlagSet) Int64Var(p *int64, name string, def int64, usage string) {
	*p = def
	f.add(name, "", usage, int64Value{p})
}

// StringSliceVar defines a flag given once per value (or comma-separated).
func (f *FlagSet) StringSliceVar(p *[]string, name string, def []string, usage string) {
	*p = def
	f.add(name, "", usage, &sliceValue{p: p})
}

// Changed reports whether the flag was given.
func (f *FlagSet) Changed(name string) bool {
	fl := f.flags[name]
	return fl != nil && fl.changed
}

func (f *FlagSet) bool(name string) bool {
	fl := f.flags[name]
	return fl != nil && fl.changed && fl.value.String() == "true"
}

// parse sets the flags in args and returns the other arguments.
func (f *FlagSet) parse(args []string) ([]string, error) {
	var rest []string
	for len(args) > 0 {
		a := args[0]
		args = args[1:]
		switch {
		case a == "--":
			return append(rest, args...), nil
		case strings.HasPrefix(a, "--"):
			name, val, hasVal := strings.Cut(a[2:], "=")
			fl := f.flags[name]
			if fl == nil {
				return nil, fmt.Errorf("unknown flag: --%s", name)
			}
			var err error
			if args, err = f.set(fl, "--"+name, val, hasVal, args); err != nil {
				return nil, err
			}
		case len(a) > 1 && a[0] == '-':
			name, val, hasVal := strings.Cut(a[1:], "=")
			fl := f.short[name]
			if fl == nil {
				return nil, fmt.Errorf("unknown shorthand flag: %q in %s", rune(name[0]), a)
			}
			var err error
			if args, err = f.set(fl, "-"+name, val, hasVal, args); err != nil {
				return nil, err
			}
		default:
			rest = append(rest, a)
		}
	}
	return rest, nil
}

// set sets fl (spelled as given) from val or, when it has none and is not
// a boolean, from the next argument.
func (f *FlagSet) set(fl *flag, given, val string, hasVal bool, args []string) ([]string, error) {
	if !hasVal {
		if fl.value.Type() == "bool" {
			val = "true"
		} else {
			if len(args) == 0 {
				return nil, fmt.Errorf("flag needs an argument: %s", given)
			}
			val, args = args[0], args[1:]
		}
	}
	if err := fl.value.Set(val); err != nil {
		return nil, fmt.Errorf("invalid argument %q for %q flag: %v", val, flagSpelling(fl), err)
	}
	fl.changed = true
	return args, nil
}

func flagSpelling(fl *flag) string {
	if fl.shorthand != "" {
		return "-" + fl.shorthand + ", --" + fl.name
	}
	return "--" + fl.name
}

// usages is the flags' help, as pflag's FlagUsages: one line each, sorted
// by name, the descriptions aligned, non-zero defaults shown.
func (f *FlagSet) usages() string {
	names := make([]string, 0, len(f.flags))
	for n := range f.flags {
		names = append(names, n)
	}
	sort.Strings(names)
	lines := make([]string, 0, len(names))
	maxlen := 0
	for _, n := range names {
		fl := f.flags[n]
		line := "      --" + fl.name
		if fl.shorthand != "" {
			line = "  -" + fl.shorthand + ", --" + fl.name
		}
		if t := fl.value.Type(); t != "bool" {
			line += " " + t
		}
		line += "\x00"
		maxlen = max(maxlen, len(line))
		line += fl.usage
		switch {
		case fl.defValue == "" || fl.defValue == "false" || fl.defValue == "0" || fl.defValue == "[]":
		case fl.value.Type() == "string":
			line += fmt.Sprintf(" (default %q)", fl.defValue)
		default:
			line += fmt.Sprintf(" (default %s)", fl.defValue)
		}
		lines = append(lines, line)
	}
	var b strings.Builder
	for _, line := range lines {
		i := strings.Index(line, "\x00")
		fmt.Fprintln(&b, line[:i], strings.Repeat(" ", maxlen-i), line[i+1:])
	}
	return b.String()
}
