package bcdcmd

import (
	"context"
	"strings"
	"testing"

	"github.com/better-compute/better-compute/internal/shared/clock"
)

// R12.1: when the control plane says the node was retired, bcd run stops
// at once with its own exit code (ExitRetired, which bcd.service does not
// restart) and says what to do, instead of reconnecting forever.
func TestRunRetiredExits(t *testing.T) {
	h := newHost(t, true)
	r := h.run(h.srv.Token+"\n", false, append([]string{"join"}, h.cfgFlag()...)...)
	want(t, "join", r, 0, "stderr", "joined as node_")
	h.srv.Sessions.Retired = true

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel() // ends the renewer bcd run started
	var out, errOut strings.Builder
	code := Main(ctx, append([]string{"run"}, h.cfgFlag()...), Env{
		Stdin: strings.NewReader(""), Stdout: &out, Stderr: &errOut,
		LookupEnv:       func(string) (string, bool) { return "", false },
		Unsetenv:        func(string) error { return nil },
		StdinIsTerminal: func() bool { return true },
		Clock:           clock.NewFake(h.srv.Now),
		HTTPClient:      h.srv.HTTPClient,
	})
	want(t, "R12.1", result{code: code, stdout: out.String(), stderr: errOut.String()}, ExitRetired, "stderr",
		"Error: INVALID_STATE: this node was retired; ", "bcd join --reset --yes")

	// R24.1: bcd doctor says so too (it called the node healthy), until a
	// new join as the message says.
	d := h.doctorAt(h.srv.Now)
	want(t, "R24.1", d, 1, "stdout", "was retired (the control plane said so to bcd run at ", "bcd join --reset --yes, then bcd join with a new token")
	join := append([]string{"join"}, h.cfgFlag()...)
	want(t, "R24.1", h.run("", true, append(join, "--reset", "--yes")...), 0, "stderr", "moved the old identity aside")
	want(t, "R24.1", h.run(h.srv.Token+"\n", false, join...), 0, "stderr", "joined as node_")
	if d := h.doctorAt(h.srv.Now); d.code != 0 {
		t.Fatalf("R24.1: doctor after joining anew: %d\n%s", d.code, d.stdout)
	}
}
