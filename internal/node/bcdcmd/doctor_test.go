package bcdcmd

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"strings"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/node/servertime"
	"github.com/better-compute/better-compute/internal/shared/bcdconfig"
	"github.com/better-compute/better-compute/internal/shared/clock"
	"github.com/better-compute/better-compute/internal/shared/pki"
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
// fails its identity check with R11.4's message.
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

// R16.2: doctor shows each pin set, oldest first, the newest marked, and
// reaches the gateway under any pin of the serving-CA set.
func TestDoctorShowsPinSets(t *testing.T) {
	h := newHost(t, true)
	cfg, err := bcdconfig.Load(h.cfgPath)
	if err != nil {
		t.Fatal(err)
	}
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	next, err := pki.Pin(&k.PublicKey)
	if err != nil {
		t.Fatal(err)
	}
	// The gateway is on the older CA of the set.
	cfg.SetPinSet(pki.KindServingCA, []string{h.srv.Pins.ServingCA, next})
	if err := cfg.Write(h.cfgPath); err != nil {
		t.Fatal(err)
	}
	r := h.doctorAt(h.srv.Now)
	for _, want := range []string{
		"serving-ca: " + h.srv.Pins.ServingCA + ", " + next + " (newest)",
		"join-signing: " + h.srv.Pins.JoinSigning + ";",
		"join-encryption: " + h.srv.Pins.JoinEncryption,
		"answers TLS under a pinned serving CA",
	} {
		if !strings.Contains(r.stdout, want) {
			t.Errorf("doctor output lacks %q:\n%s", want, r.stdout)
		}
	}
}

// R19.3: doctor shows the offset from the control plane's clock bcd
// learned, and warns when it is large.
func TestDoctorShowsClockOffset(t *testing.T) {
	h := newHost(t, true)
	if r := h.run(h.srv.Token+"\n", false, append([]string{"join"}, h.cfgFlag()...)...); r.code != 0 {
		t.Fatalf("join: %s", r.stderr)
	}
	for _, tc := range []struct {
		off  time.Duration
		want string
	}{
		{2 * time.Second, "ok      offset 2s from the control plane's clock"},
		{-time.Hour, "warn    offset -1h0m0s from the control plane's clock"},
	} {
		ofs := servertime.New(servertime.Config{Dir: h.cfg.DataDir, Clock: clock.NewFake(h.srv.Now)})
		if _, err := ofs.Learn(h.srv.Now.Add(tc.off).UnixMilli()); err != nil {
			t.Fatal(err)
		}
		r := h.doctorAt(h.srv.Now)
		if !strings.Contains(r.stdout, tc.want) || !strings.Contains(r.stdout, "fix NTP") {
			t.Errorf("doctor with the clock %s off lacks %q:\n%s", tc.off, tc.want, r.stdout)
		}
	}
}
