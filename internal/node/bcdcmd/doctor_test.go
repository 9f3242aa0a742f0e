package bcdcmd

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/shared/clock"
)

// doctorAt runs bcd doctor with the clock at now.
func (h *host) doctorAt(now time.Time, args ...string) result {
	h.t.Helper()
	var out, errOut strings.Builder
	code := Main(context.Background(), append([]string{"doctor", "--config", h.cfgPath}, args...), Env{
		Stdin: strings.NewReader(""), Stdout: &out, Stderr: &errOut,
		LookupEnv: func(string) (string, bool) { return "", false }, Unsetenv: func(string) error { return nil },
		StdinIsTerminal: func() bool { return true }, Clock: clock.NewFake(now), HTTPClient: h.srv.HTTPClient,
	})
	return result{code: code, stdout: out.String(), stderr: errOut.String()}
}

// R11.4: doctor passes on a joined host, and after the certificate expired it
// fails its identity check with the page's message.
func TestDoctorR11_4(t *testing.T) {
	h := newHost(t, true)
	if r := h.doctorAt(h.srv.Now); r.code != 0 || !strings.Contains(r.stdout, "not joined") {
		t.Fatalf("doctor before join: %d\n%s%s", r.code, r.stdout, r.stderr)
	}
	if r := h.run(h.srv.Token+"\n", false, append([]string{"join"}, h.cfgFlag()...)...); r.code != 0 {
		t.Fatalf("join: %s", r.stderr)
	}
	r := h.doctorAt(h.srv.Now)
	if r.code != 0 {
		t.Fatalf("doctor on a joined host: %d\n%s", r.code, r.stdout)
	}
	for _, want := range []string{"config", "join key", "identity", "gateway", "tpm"} {
		if !strings.Contains(r.stdout, want) {
			t.Errorf("doctor output lacks the %s check:\n%s", want, r.stdout)
		}
	}
	r = h.doctorAt(h.srv.Now.Add(48*time.Hour), "--json")
	if r.code != 1 || !strings.Contains(r.stdout, "the certificate expired at ") ||
		!strings.Contains(r.stdout, "join again as root: bcd join --reset --yes, then bcd join") {
		t.Fatalf("doctor after expiry: %d\n%s", r.code, r.stdout)
	}
}

// R11.4: a config that does not exist is a failed check, not a crash.
func TestDoctorNoConfig(t *testing.T) {
	h := newHost(t, false)
	if r := h.doctorAt(h.srv.Now); r.code != 1 || !strings.Contains(r.stdout, "does not exist") {
		t.Fatalf("doctor without config: %d\n%s", r.code, r.stdout)
	}
}
