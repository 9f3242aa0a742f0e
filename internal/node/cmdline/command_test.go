package cmdline

import (
	"context"
	"strings"
	"testing"
)

// tree is a root with a leaf (flags of each kind) and a group.
func tree(got *[]string, vals *leafFlags) *Command {
	root := &Command{Use: "bcd", Short: "the daemon", Version: "1.2.3"}
	leaf := &Command{Use: "join", Short: "Join", Example: "  bcd join --config x",
		RunE: func(cmd *Command, args []string) error {
			*got = append([]string{"join"}, args...)
			if cmd.Flags().Changed("mac") {
				*got = append(*got, "mac changed")
			}
			return nil
		}}
	fl := leaf.Flags()
	fl.StringVar(&vals.config, "config", "/etc/bcd/config.toml", "the config")
	fl.BoolVar(&vals.yes, "yes", false, "confirm")
	fl.Int64Var(&vals.epoch, "epoch", 0, "an epoch")
	fl.StringSliceVar(&vals.macs, "mac", nil, "a MAC, once per NIC")
	group := &Command{Use: "site", Short: "Site agent"}
	group.AddCommand(&Command{Use: "vouch --mac MAC", Short: "Vouch", Args: NoArgs,
		RunE: func(*Command, []string) error { *got = []string{"vouch"}; return nil }})
	root.AddCommand(leaf, group)
	return root
}

type leafFlags struct {
	config string
	yes    bool
	epoch  int64
	macs   []string
}

// bcd's command line as cobra and pflag parsed it: flags before, after and
// between arguments, --name=value, booleans alone, repeated slices.
func TestExecute(t *testing.T) {
	tests := []struct {
		args []string
		run  string // what RunE saw, joined by "|"
		err  string
		out  string // in the help or version printed
		want leafFlags
	}{
		{args: []string{"join", "--config", "c", "--yes", "a", "--epoch=3", "--mac", "m1", "--mac=m2,m3", "--", "--b"},
			run: "join|a|--b|mac changed", want: leafFlags{config: "c", yes: true, epoch: 3, macs: []string{"m1", "m2", "m3"}}},
		{args: []string{"join"}, run: "join", want: leafFlags{config: "/etc/bcd/config.toml"}},
		{args: []string{"join", "--yes=false"}, run: "join", want: leafFlags{config: "/etc/bcd/config.toml"}},
		{args: []string{"join", "--no-such-flag"}, err: "unknown flag: --no-such-flag"},
		{args: []string{"join", "--config"}, err: "flag needs an argument: --config"},
		{args: []string{"join", "--epoch", "x"}, err: `invalid argument "x" for "--epoch" flag`},
		{args: []string{"join", "-x"}, err: `unknown shorthand flag: 'x' in -x`},
		{args: []string{"joni"}, err: `unknown command "joni" for "bcd"; did you mean "join"? (see bcd --help)`},
		{args: []string{"site", "vouh", "--mac", "m"}, err: `unknown command "vouh" for "bcd site"; did you mean "vouch"?`},
		{args: []string{"site", "vouch", "extra"}, err: `unknown command "extra" for "bcd site vouch"`},
		{args: []string{"site", "vouch"}, run: "vouch"},
		{args: []string{"site", "--json", "vouch"}, err: "unknown flag: --json"},
		{args: []string{"site", "--mac", "m", "vouch"}, err: `unknown command "m" for "bcd site"`},
		{args: []string{"site", "--help", "vouch"}, out: "Usage:\n  bcd site vouch --mac MAC [flags]"},
		{args: []string{"--no-such-flag"}, err: "unknown flag: --no-such-flag"},
		{args: []string{"help", "nope"}, err: `unknown command "nope" for "bcd"`},
		{args: []string{"--version"}, out: "bcd version 1.2.3\n"},
		{args: []string{"-v"}, out: "bcd version 1.2.3\n"},
		{args: nil, out: "the daemon\n\nUsage:\n  bcd [command]\n\nAvailable Commands:\n" +
			"  help        Help about any command\n  join        Join\n  site        Site agent\n\n" +
			"Flags:\n  -h, --help      help for bcd\n  -v, --version   version for bcd\n\n" +
			"Use \"bcd [command] --help\" for more information about a command.\n"},
		{args: []string{"join", "--help"}, out: "Join\n\nUsage:\n  bcd join [flags]\n\nExamples:\n  bcd join --config x\n\n" +
			"Flags:\n      --config string   the config (default \"/etc/bcd/config.toml\")\n" +
			"      --epoch int       an epoch\n  -h, --help            help for join\n" +
			"      --mac strings     a MAC, once per NIC\n      --yes             confirm\n"},
		{args: []string{"help", "site", "vouch"}, out: "Vouch\n\nUsage:\n  bcd site vouch --mac MAC [flags]\n\n" +
			"Flags:\n  -h, --help   help for vouch\n"},
		{args: []string{"site"}, out: "Usage:\n  bcd site [command]\n\nAvailable Commands:\n  vouch       Vouch\n"},
	}
	for _, tt := range tests {
		t.Run(strings.Join(tt.args, " "), func(t *testing.T) {
			var run []string
			var vals leafFlags
			var out strings.Builder
			err := tree(&run, &vals).Execute(context.Background(), tt.args, &out)
			if tt.err != "" {
				if err == nil || !strings.Contains(err.Error(), tt.err) {
					t.Fatalf("err = %v, want %q", err, tt.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got := strings.Join(run, "|"); got != tt.run {
				t.Errorf("ran %q, want %q", got, tt.run)
			}
			if tt.out != "" && !strings.Contains(out.String(), tt.out) {
				t.Errorf("printed\n%s\nwant\n%s", out.String(), tt.out)
			}
			if tt.run != "" && tt.run != "vouch" && (vals.config != tt.want.config || vals.yes != tt.want.yes ||
				vals.epoch != tt.want.epoch || strings.Join(vals.macs, ",") != strings.Join(tt.want.macs, ",")) {
				t.Errorf("flags %+v, want %+v", vals, tt.want)
			}
		})
	}
}
