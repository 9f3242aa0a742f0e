package enroll

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/better-compute/better-compute/internal/checks/enrolltest"
	"github.com/better-compute/better-compute/internal/controlplane/ca"
	"github.com/better-compute/better-compute/internal/node/identity"
	"github.com/better-compute/better-compute/internal/shared/bcdconfig"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/pki"
	"github.com/better-compute/better-compute/internal/shared/wire"
)

// onDisk writes the env's config.toml, so what a join learns is saved.
func (e *env) onDisk() {
	e.t.Helper()
	if err := e.cfg.Write(e.cfgPath); err != nil {
		e.t.Fatal(err)
	}
}

func (e *env) files() string {
	e.t.Helper()
	c, err := os.ReadFile(e.cfgPath)
	if err != nil {
		e.t.Fatal(err)
	}
	k, _ := os.ReadFile(filepath.Join(filepath.Dir(e.cfgPath), bcdconfig.EncryptionKeyFile))
	return string(c) + "\n" + string(k)
}

func (e *env) saved() *bcdconfig.Config {
	e.t.Helper()
	c, err := bcdconfig.Load(e.cfgPath)
	if err != nil {
		e.t.Fatal(err)
	}
	return c
}

func (e *env) generation() *ca.Bundle {
	e.t.Helper()
	b, err := ca.Generate(enrolltest.TrustDomain, e.now.Add(-time.Hour))
	if err != nil {
		e.t.Fatal(err)
	}
	return b
}

func pinOfKey(t *testing.T, pub any) string {
	t.Helper()
	p, err := pki.Pin(pub)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// R16.2: a join answer's statements count only when a pinned key signed
// them. Vouched rotations of the signing and encryption keys are saved
// (config.toml and the jwk); injected ones change nothing.
func TestJoinLearnsAnswerStatements(t *testing.T) {
	for _, vouched := range []bool{true, false} {
		t.Run(map[bool]string{true: "vouched", false: "injected"}[vouched], func(t *testing.T) {
			e := newEnv(t, envOption{})
			e.onDisk()
			next := e.generation()
			signer := e.bundle
			if !vouched {
				signer = e.generation()
			}
			e.fake.SetKeyStatements([]string{
				enrolltest.Statement(t, pki.KindJoinSigning, pki.ActionTrust, signer.JoinSigningKey, next.JoinSigningCert.PublicKey),
				enrolltest.Statement(t, pki.KindJoinEncryption, pki.ActionTrust, signer.JoinEncryptionKey, &next.JoinEncryptionKey.PublicKey),
			})
			before := e.files()
			if _, err := e.joiner(e.cfg).Join(context.Background(), e.opts()); err != nil {
				t.Fatal(err)
			}
			if !vouched {
				if e.files() != before {
					t.Error("injected statements changed config.toml or the jwk")
				}
				return
			}
			saved := e.saved()
			if diff := cmp.Diff([]string{e.pins.JoinSigning, pinOfKey(t, next.JoinSigningCert.PublicKey)}, saved.JoinSigningPins()); diff != "" {
				t.Errorf("signing set (-want +got):\n%s", diff)
			}
			newest := pinOfKey(t, &next.JoinEncryptionKey.PublicKey)
			if diff := cmp.Diff([]string{e.pins.JoinEncryption, newest}, saved.JoinEncryptionPins()); diff != "" {
				t.Errorf("encryption set (-want +got):\n%s", diff)
			}
			if saved.JoinEncryptionKeyPin != newest {
				t.Errorf("join_encryption_key_pin %s is not the newest", saved.JoinEncryptionKeyPin)
			}
			key, found, err := bcdconfig.LoadEncryptionKey(filepath.Dir(e.cfgPath), newest)
			if err != nil || !found || !key.Equal(&next.JoinEncryptionKey.PublicKey) {
				t.Errorf("jwk: found %v, err %v", found, err)
			}
		})
	}
}

// R16.2: the well-known document's statements, fetched for the
// encryption key, count only when a pinned key signed them.
func TestJoinLearnsWellKnownStatements(t *testing.T) {
	for _, vouched := range []bool{true, false} {
		t.Run(map[bool]string{true: "vouched", false: "injected"}[vouched], func(t *testing.T) {
			e := newEnv(t, envOption{noKeyFile: true})
			e.onDisk()
			next := e.generation()
			signer := e.bundle
			if !vouched {
				signer = e.generation()
			}
			st := enrolltest.Statement(t, pki.KindServingCA, pki.ActionTrust, signer.ServingCAKey, next.ServingCA.PublicKey)
			e.setDoc(func(d *wire.WellKnown) { d.Join.KeyStatements = []string{st} })
			before := e.files()
			opts := e.opts()
			opts.Server = e.srv.URL
			if _, err := e.joiner(e.cfg).Join(context.Background(), opts); err != nil {
				t.Fatal(err)
			}
			if !vouched {
				if e.files() != before {
					t.Error("injected statements changed config.toml")
				}
				return
			}
			if diff := cmp.Diff([]string{e.pins.ServingCA, pinOfKey(t, next.ServingCA.PublicKey)}, e.saved().ServingCAPins()); diff != "" {
				t.Errorf("serving-CA set (-want +got):\n%s", diff)
			}
		})
	}
}

// R16.2: a join through a gateway on a serving CA rotated while this
// machine was offline: bcd asks Keys once; a statement of the pinned CA
// lets the join through on the second dial, one of an unknown key leaves
// the gateway refused, and the token unsent.
func TestJoinAfterOfflineServingCARotation(t *testing.T) {
	for _, vouched := range []bool{true, false} {
		t.Run(map[bool]string{true: "vouched", false: "unknown key"}[vouched], func(t *testing.T) {
			e := newEnv(t, envOption{})
			e.onDisk()
			next := e.generation()
			signer := e.bundle
			if !vouched {
				signer = e.generation()
			}
			e.fake.SetKeyStatements([]string{enrolltest.Statement(t, pki.KindServingCA, pki.ActionTrust, signer.ServingCAKey, next.ServingCA.PublicKey)})
			e.srv.SetGatewayBundle(t, next)
			before := e.files()
			_, err := e.joiner(e.cfg).Join(context.Background(), e.opts())
			if n := e.fake.KeysCalls(); n != 1 {
				t.Errorf("Keys calls = %d, want 1", n)
			}
			if !vouched {
				if errs.CodeOf(err) != errs.Unauthenticated || !strings.Contains(errs.MessageOf(err), "refusing the gateway") || !strings.Contains(errs.MessageOf(err), "the token was not sent") {
					t.Fatalf("err = %v, want the pin refusal", err)
				}
				if e.fake.Calls() != 0 {
					t.Error("the join reached the JoinService")
				}
				if e.files() != before {
					t.Error("config.toml changed")
				}
				return
			}
			if err != nil {
				t.Fatalf("join after the Keys fallback: %v", err)
			}
			if diff := cmp.Diff([]string{e.pins.ServingCA, pinOfKey(t, next.ServingCA.PublicKey)}, e.saved().ServingCAPins()); diff != "" {
				t.Errorf("serving-CA set (-want +got):\n%s", diff)
			}
		})
	}
}

// R16.2: a machine offline long enough for its certificate to expire
// re-joins with x509pop through a gateway on a rotated serving CA (Keys,
// then the second dial), and learns the rest of the chain, a rotated
// join-signing key whose answer it accepts, from the re-join answer.
func TestRejoinAfterOfflineRotation(t *testing.T) {
	e := newEnv(t, envOption{})
	e.onDisk()
	e.joinExpired(t)
	next := e.generation()
	e.fake.SetKeyStatements([]string{
		enrolltest.Statement(t, pki.KindServingCA, pki.ActionTrust, e.bundle.ServingCAKey, next.ServingCA.PublicKey),
		enrolltest.Statement(t, pki.KindServingCA, pki.ActionRetire, next.ServingCAKey, e.bundle.ServingCA.PublicKey),
		enrolltest.Statement(t, pki.KindJoinSigning, pki.ActionTrust, e.bundle.JoinSigningKey, next.JoinSigningCert.PublicKey),
	})
	e.srv.SetGatewayBundle(t, next)
	// The control plane signs with the next key already: bcd learns it
	// from Keys before the answer comes.
	e.fake.UseSigner(next.JoinSigningKey, next.JoinSigningCert)
	if _, err := e.joiner(e.cfg).Join(context.Background(), Options{Attestor: identity.AttestorX509Pop}); err != nil {
		t.Fatalf("x509pop re-join after an offline rotation: %v", err)
	}
	saved := e.saved()
	if diff := cmp.Diff([]string{pinOfKey(t, next.ServingCA.PublicKey)}, saved.ServingCAPins()); diff != "" {
		t.Errorf("serving-CA set (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff([]string{e.pins.JoinSigning, pinOfKey(t, next.JoinSigningCert.PublicKey)}, saved.JoinSigningPins()); diff != "" {
		t.Errorf("signing set (-want +got):\n%s", diff)
	}
	if n := e.fake.KeysCalls(); n != 1 {
		t.Errorf("Keys calls = %d, want 1", n)
	}
}
