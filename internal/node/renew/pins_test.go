package renew_test

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/better-compute/better-compute/internal/checks/enrolltest"
	"github.com/better-compute/better-compute/internal/controlplane/ca"
	"github.com/better-compute/better-compute/internal/node/config"
	"github.com/better-compute/better-compute/internal/node/enroll"
	"github.com/better-compute/better-compute/internal/node/identity"
	"github.com/better-compute/better-compute/internal/node/renew"
	"github.com/better-compute/better-compute/internal/shared/bcdconfig"
	"github.com/better-compute/better-compute/internal/shared/clock"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/pki"
)

// pinned is a bcd joined through the fake gateway, with its config.toml
// and join-encryption.jwk on disk, renewing with live pins persisted there.
type pinned struct {
	srv     *enrolltest.Server
	path    string
	dir     string
	cfg     *bcdconfig.Config
	store   *identity.Store
	clock   *clock.Fake
	pins    *config.Pins
	renewer *renew.Renewer
	logs    *bytes.Buffer
}

func newPinned(t *testing.T) *pinned {
	t.Helper()
	s := enrolltest.New(t, enrolltest.Options{})
	root := t.TempDir()
	p := &pinned{srv: s, cfg: s.Config(t, root), path: filepath.Join(root, "etc", "bcd", "config.toml"), clock: clock.NewFake(s.Now.Add(time.Minute)), logs: &bytes.Buffer{}}
	p.dir = filepath.Dir(p.path)
	if err := p.cfg.Write(p.path); err != nil {
		t.Fatal(err)
	}
	s.WriteKeyFile(t, p.dir)
	p.store = &identity.Store{Dir: p.cfg.DataDir}
	j, err := enroll.New(enroll.Config{BCD: p.cfg, ConfigPath: p.path, Store: p.store, Clock: p.clock, HTTPClient: s.HTTPClient})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := j.Join(context.Background(), enroll.Options{Token: s.Token}); err != nil {
		t.Fatal(err)
	}
	log := slog.New(slog.NewTextHandler(p.logs, nil))
	p.pins = config.NewPins(p.path, p.cfg, log)
	p.renewer, err = renew.New(renew.Config{BCD: p.cfg, Store: p.store, Clock: p.clock, HTTPClient: s.HTTPClient, Log: log, Pins: p.pins})
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func (p *pinned) files(t *testing.T) string {
	t.Helper()
	cfg, err := os.ReadFile(p.path)
	if err != nil {
		t.Fatal(err)
	}
	jwk, err := os.ReadFile(filepath.Join(p.dir, bcdconfig.EncryptionKeyFile))
	if err != nil {
		t.Fatal(err)
	}
	return string(cfg) + "\n" + string(jwk)
}

func pinOf(t *testing.T, pub any) string {
	t.Helper()
	pin, err := pki.Pin(pub)
	if err != nil {
		t.Fatal(err)
	}
	return pin
}

func generation(t *testing.T, s *enrolltest.Server) *ca.Bundle {
	t.Helper()
	b, err := ca.Generate(enrolltest.TrustDomain, s.Now.Add(-time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// R16.2: statements a relay injects, signed by keys bcd does not pin, in a
// renewal answer or in Keys, are ignored: config.toml and the jwk stay as
// they were, and a gateway on an unvouched serving CA stays refused.
func TestRenewIgnoresInjectedStatements(t *testing.T) {
	p := newPinned(t)
	evil := generation(t, p.srv)
	next := generation(t, p.srv)
	p.srv.JoinService.SetKeyStatements([]string{
		enrolltest.Statement(t, pki.KindServingCA, pki.ActionTrust, evil.ServingCAKey, next.ServingCA.PublicKey),
		enrolltest.Statement(t, pki.KindJoinSigning, pki.ActionTrust, evil.JoinSigningKey, next.JoinSigningCert.PublicKey),
		enrolltest.Statement(t, pki.KindJoinEncryption, pki.ActionTrust, evil.JoinEncryptionKey, &next.JoinEncryptionKey.PublicKey),
		enrolltest.Statement(t, pki.KindServingCA, pki.ActionRetire, evil.ServingCAKey, p.srv.Bundle.ServingCA.PublicKey),
		"garbage",
	})
	before := p.files(t)
	if _, err := p.renewer.RenewOnce(context.Background()); err != nil {
		t.Fatal(err)
	}
	if p.files(t) != before {
		t.Error("the renewal answer's injected statements changed config.toml or the jwk")
	}

	// The gateway moves to a serving CA the injected statements vouch for:
	// Keys is asked once, and the gateway is still refused.
	p.srv.SetGatewayBundle(t, next)
	_, err := p.renewer.RenewOnce(context.Background())
	if e, ok := errs.As(err); !ok || e.Code != errs.Unauthenticated || !strings.Contains(e.Message, "refusing the gateway") || !strings.Contains(e.Message, "nothing was sent") {
		t.Fatalf("renewal through an unvouched gateway: %v", err)
	}
	if n := p.srv.JoinService.KeysCalls(); n != 1 {
		t.Errorf("Keys calls = %d, want 1", n)
	}
	if p.files(t) != before {
		t.Error("the Keys answer's injected statements changed config.toml or the jwk")
	}
	if diff := cmp.Diff([]string{p.srv.Pins.ServingCA}, p.pins.Set(pki.KindServingCA)); diff != "" {
		t.Errorf("live serving-CA set (-want +got):\n%s", diff)
	}
}

// R16.2: two rotations of every kind learned in one renewal answer (each
// key vouches for the next, the newest retires the older two): config.toml
// names only the newest keys, the jwk holds the newest encryption key, and
// the next renewal goes through a gateway of the newest serving CA, under
// the newest join-signing key.
func TestRenewLearnsChainOfRotations(t *testing.T) {
	p := newPinned(t)
	g1, g2 := generation(t, p.srv), generation(t, p.srv)
	g0 := p.srv.Bundle
	var st []string
	st = append(st,
		enrolltest.Statement(t, pki.KindServingCA, pki.ActionTrust, g0.ServingCAKey, g1.ServingCA.PublicKey),
		enrolltest.Statement(t, pki.KindServingCA, pki.ActionTrust, g1.ServingCAKey, g2.ServingCA.PublicKey),
		enrolltest.Statement(t, pki.KindServingCA, pki.ActionRetire, g2.ServingCAKey, g0.ServingCA.PublicKey),
		enrolltest.Statement(t, pki.KindServingCA, pki.ActionRetire, g2.ServingCAKey, g1.ServingCA.PublicKey),
		enrolltest.Statement(t, pki.KindJoinSigning, pki.ActionTrust, g0.JoinSigningKey, g1.JoinSigningCert.PublicKey),
		enrolltest.Statement(t, pki.KindJoinSigning, pki.ActionTrust, g1.JoinSigningKey, g2.JoinSigningCert.PublicKey),
		enrolltest.Statement(t, pki.KindJoinSigning, pki.ActionRetire, g2.JoinSigningKey, g0.JoinSigningCert.PublicKey),
		enrolltest.Statement(t, pki.KindJoinSigning, pki.ActionRetire, g2.JoinSigningKey, g1.JoinSigningCert.PublicKey),
		enrolltest.Statement(t, pki.KindJoinEncryption, pki.ActionTrust, g0.JoinEncryptionKey, &g1.JoinEncryptionKey.PublicKey),
		enrolltest.Statement(t, pki.KindJoinEncryption, pki.ActionTrust, g1.JoinEncryptionKey, &g2.JoinEncryptionKey.PublicKey),
		enrolltest.Statement(t, pki.KindJoinEncryption, pki.ActionRetire, g2.JoinEncryptionKey, &g0.JoinEncryptionKey.PublicKey),
		enrolltest.Statement(t, pki.KindJoinEncryption, pki.ActionRetire, g2.JoinEncryptionKey, &g1.JoinEncryptionKey.PublicKey),
	)
	p.srv.JoinService.SetKeyStatements(st)
	if _, err := p.renewer.RenewOnce(context.Background()); err != nil {
		t.Fatal(err)
	}
	saved, err := bcdconfig.Load(p.path)
	if err != nil {
		t.Fatal(err)
	}
	want := map[string][]string{
		pki.KindServingCA:      {pinOf(t, g2.ServingCA.PublicKey)},
		pki.KindJoinSigning:    {pinOf(t, g2.JoinSigningCert.PublicKey)},
		pki.KindJoinEncryption: {pinOf(t, &g2.JoinEncryptionKey.PublicKey)},
	}
	for kind, w := range want {
		if diff := cmp.Diff(w, saved.PinSet(kind)); diff != "" {
			t.Errorf("saved %s (-want +got):\n%s", kind, diff)
		}
		if diff := cmp.Diff(w, p.pins.Set(kind)); diff != "" {
			t.Errorf("live %s (-want +got):\n%s", kind, diff)
		}
	}
	key, found, err := bcdconfig.LoadEncryptionKey(p.dir, saved.JoinEncryptionKeyPin)
	if err != nil || !found || !key.Equal(&g2.JoinEncryptionKey.PublicKey) {
		t.Errorf("jwk: found %v, err %v", found, err)
	}
	if !strings.Contains(p.logs.String(), "learned rotated keys") {
		t.Errorf("no log line of the change:\n%s", p.logs)
	}

	// The control plane moves to the newest keys; the old ones are gone.
	p.srv.SetGatewayBundle(t, g2)
	p.srv.JoinService.UseSigner(g2.JoinSigningKey, g2.JoinSigningCert)
	if _, err := p.renewer.RenewOnce(context.Background()); err != nil {
		t.Fatalf("renewal on the newest keys: %v", err)
	}
	if n := p.srv.JoinService.KeysCalls(); n != 0 {
		t.Errorf("Keys calls = %d, want 0: the pins were already learned", n)
	}
}

// R16.2: a bcd that was offline through a rotation of the serving CA (the
// old CA vouched for the new one, then was retired) finds its gateway on a
// CA it does not pin: it asks Keys, follows the statement the old CA
// signed, and the renewal goes through on the second dial. Signed by an
// unknown key instead, the statement is ignored and the gateway refused.
func TestRenewAfterOfflineServingCARotation(t *testing.T) {
	tests := []struct {
		name   string
		vouch  func(old, next, evil *ca.Bundle) string
		wantOK bool
	}{
		{name: "vouched by the pinned CA", wantOK: true, vouch: func(old, next, _ *ca.Bundle) string {
			return enrolltest.Statement(t, pki.KindServingCA, pki.ActionTrust, old.ServingCAKey, next.ServingCA.PublicKey)
		}},
		{name: "vouched by an unknown key", vouch: func(_, next, evil *ca.Bundle) string {
			return enrolltest.Statement(t, pki.KindServingCA, pki.ActionTrust, evil.ServingCAKey, next.ServingCA.PublicKey)
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := newPinned(t)
			old, next, evil := p.srv.Bundle, generation(t, p.srv), generation(t, p.srv)
			before := p.files(t)
			p.srv.JoinService.SetKeyStatements([]string{
				tt.vouch(old, next, evil),
				enrolltest.Statement(t, pki.KindServingCA, pki.ActionRetire, next.ServingCAKey, old.ServingCA.PublicKey),
			})
			p.srv.SetGatewayBundle(t, next)
			_, err := p.renewer.RenewOnce(context.Background())
			if n := p.srv.JoinService.KeysCalls(); n != 1 {
				t.Errorf("Keys calls = %d, want 1", n)
			}
			if !tt.wantOK {
				if _, ok := enroll.PinFailure(err); ok || errs.CodeOf(err) != errs.Unauthenticated || !strings.Contains(errs.MessageOf(err), "refusing the gateway") {
					t.Fatalf("err = %v, want the pin refusal", err)
				}
				if p.files(t) != before {
					t.Error("config.toml or the jwk changed")
				}
				return
			}
			if err != nil {
				t.Fatalf("renewal after the Keys fallback: %v", err)
			}
			saved, err := bcdconfig.Load(p.path)
			if err != nil {
				t.Fatal(err)
			}
			if diff := cmp.Diff([]string{pinOf(t, next.ServingCA.PublicKey)}, saved.ServingCAPins()); diff != "" {
				t.Errorf("saved serving-CA set (-want +got):\n%s", diff)
			}
			if saved.JoinSigningKeyPin != p.cfg.JoinSigningKeyPin || saved.JoinEncryptionKeyPin != p.cfg.JoinEncryptionKeyPin {
				t.Error("the other pins changed")
			}
		})
	}
}

// R21.1: a join-signing rotation run back to back (prepare, activate and
// retire at once, the leak runbook) while bcd sleeps: the next renewal
// answer is signed by a key bcd does not pin yet. bcd accepts it because a
// chain from its pinned key vouches for that key, found in the answer
// itself or, when a relay dropped it there, in the gateway's Keys answer;
// then it pins only the new key. A chain from a key it never pinned is
// refused and changes nothing.
func TestRenewAcrossBackToBackJoinSigningRotation(t *testing.T) {
	tests := []struct {
		name      string
		strip     bool
		evil      bool
		wantKeys  int
		wantError bool
	}{
		{name: "chain in the answer"},
		{name: "chain dropped by the relay, from Keys", strip: true, wantKeys: 1},
		{name: "chain from an unpinned key", evil: true, wantKeys: 1, wantError: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := newPinned(t)
			old, next, evil := p.srv.Bundle, generation(t, p.srv), generation(t, p.srv)
			voucher := old.JoinSigningKey
			if tt.evil {
				voucher = evil.JoinSigningKey
			}
			p.srv.JoinService.SetKeyStatements([]string{
				enrolltest.Statement(t, pki.KindJoinSigning, pki.ActionTrust, voucher, next.JoinSigningCert.PublicKey),
				enrolltest.Statement(t, pki.KindJoinSigning, pki.ActionRetire, next.JoinSigningKey, old.JoinSigningCert.PublicKey),
			})
			p.srv.JoinService.UseSigner(next.JoinSigningKey, next.JoinSigningCert)
			p.srv.JoinService.StripOuterStatements(tt.strip)
			before := p.files(t)
			_, err := p.renewer.RenewOnce(context.Background())
			if n := p.srv.JoinService.KeysCalls(); n != tt.wantKeys {
				t.Errorf("Keys calls = %d, want %d", n, tt.wantKeys)
			}
			if tt.wantError {
				var re *enroll.ResponseError
				if !errors.As(err, &re) || re.Check != enroll.CheckSignature {
					t.Fatalf("err = %v, want the signature check's refusal", err)
				}
				if p.files(t) != before {
					t.Error("config.toml or the jwk changed")
				}
				return
			}
			if err != nil {
				t.Fatalf("renewal signed by the rotated key: %v", err)
			}
			want := []string{pinOf(t, next.JoinSigningCert.PublicKey)}
			if diff := cmp.Diff(want, p.pins.Set(pki.KindJoinSigning)); diff != "" {
				t.Errorf("live join-signing set (-want +got):\n%s", diff)
			}
			saved, err := bcdconfig.Load(p.path)
			if err != nil {
				t.Fatal(err)
			}
			if diff := cmp.Diff(want, saved.JoinSigningPins()); diff != "" {
				t.Errorf("saved join-signing set (-want +got):\n%s", diff)
			}
			// The old key, retired, is never pinned again.
			if _, err := p.pins.Learn("keys", []string{enrolltest.Statement(t, pki.KindJoinSigning, pki.ActionTrust, next.JoinSigningKey, old.JoinSigningCert.PublicKey)}); err != nil {
				t.Fatal(err)
			}
			if diff := cmp.Diff(want, p.pins.Set(pki.KindJoinSigning)); diff != "" {
				t.Errorf("after a statement trusting the retired key again (-want +got):\n%s", diff)
			}
		})
	}
}
