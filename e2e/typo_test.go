package e2e

import (
	"strings"
	"testing"
)

// R24.1: a mistyped subcommand, of either binary, with or without the
// flags the meant command takes, exits non-zero with "unknown command"
// and the subcommand meant, instead of printing help and exiting 0 (or
// blaming a valid flag).
func TestMistypedSubcommandsR24_1(t *testing.T) {
	bc, bcd := binaries(t)
	for _, c := range []struct {
		bin  string
		args []string
		want string
	}{
		{bc, []string{"nodes", "lst"}, `"list"`},
		{bc, []string{"nodes", "lst", "--tenant", "ten_x"}, `"list"`},
		{bc, []string{"join-tokens", "craete", "--tenant", "ten_x", "--pool", "pool_x"}, `"create"`},
		{bc, []string{"pki", "rotat", "serving-ca"}, `"rotate"`},
		{bcd, []string{"site", "vouh"}, `"vouch"`},
	} {
		out, errOut, code := run(t, nil, "", c.bin, c.args...)
		if code == 0 || out != "" || !strings.Contains(errOut, "INVALID_ARGUMENT") || !strings.Contains(errOut, "unknown command") || !strings.Contains(errOut, "did you mean "+c.want) {
			t.Errorf("%v: exit %d, stdout %q, stderr %q; want INVALID_ARGUMENT unknown command, did you mean %s", c.args, code, out, errOut, c.want)
		}
	}
	// A group alone still prints its help.
	if out, _, code := run(t, nil, "", bc, "nodes"); code != 0 || !strings.Contains(out, "Available Commands") {
		t.Errorf("better-compute nodes: exit %d, %q", code, out)
	}
}
