package rotation_test

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/controlplane/ca"
	"github.com/better-compute/better-compute/internal/controlplane/rotation"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
	"github.com/better-compute/better-compute/internal/shared/errs"
)

var nextSecret = []byte("the-next-rotation-secret-of-enough-length-9876543210")

// R16.1: the secret rotates with the keys readable under either secret at
// every phase (a replica on the old one and one on the new one both open
// every key until retire), the PKI directory follows, and no key rotates
// meanwhile.
func TestSecretRotationR16_1(t *testing.T) {
	ctx := context.Background()
	db := storetest.OpenSQLite(t)
	now := time.Date(2026, 12, 2, 10, 0, 0, 0, time.UTC)
	dir := filepath.Join(t.TempDir(), "pki")
	base, err := ca.Init(dir, "compute.example.com", secret, now)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := rotation.Open(ctx, rotation.Config{DB: db, Base: base, Secret: secret}); err != nil {
		t.Fatal(err)
	}
	// A rotated key, so a database row holds an encrypted key too.
	for _, p := range []string{rotation.PhasePrepare, rotation.PhaseActivate} {
		if _, err := rotation.Rotate(ctx, db, base, secret, rotation.Op{Kind: ca.KindJoinSigning, Phase: p, Now: now}); err != nil {
			t.Fatal(err)
		}
	}
	opens := func(phase string, secrets ...[]byte) {
		t.Helper()
		for _, s := range secrets {
			b, err := ca.Load(dir, s)
			if err != nil {
				t.Fatalf("after %s: the PKI directory does not open: %v", phase, err)
			}
			ring, err := rotation.Open(ctx, rotation.Config{DB: db, Base: b, Secret: s})
			if err != nil {
				t.Fatalf("after %s: a replica does not open the keys: %v", phase, err)
			}
			if ring.Current().JoinSigningCert.Raw == nil {
				t.Fatal("no join-signing key")
			}
		}
	}
	secretOp := func(phase string, next []byte) error {
		_, err := rotation.RotateSecret(ctx, db, base, rotation.SecretOp{Phase: phase, Secret: secret, Next: next, PKIDir: dir, Actor: "cli:test", Now: now})
		return err
	}
	if err := secretOp(rotation.PhasePrepare, []byte("weak")); errs.CodeOf(err) != errs.InvalidConfig {
		t.Fatalf("a weak next secret: %v, want INVALID_CONFIG", err)
	}
	for _, step := range []struct {
		phase string
		opens [][]byte
	}{
		{rotation.PhasePrepare, [][]byte{secret, nextSecret}},
		{rotation.PhaseActivate, [][]byte{secret, nextSecret}},
		{rotation.PhaseRollback, [][]byte{secret, nextSecret}},
		{rotation.PhaseActivate, [][]byte{secret, nextSecret}},
	} {
		if err := secretOp(step.phase, nextSecret); err != nil {
			t.Fatalf("%s: %v", step.phase, err)
		}
		opens(step.phase, step.opens...)
		if _, err := rotation.Rotate(ctx, db, base, secret, rotation.Op{Kind: ca.KindJoinSigning, Phase: rotation.PhaseRetire, Now: now}); errs.CodeOf(err) != errs.InvalidState {
			t.Fatalf("a key rotation while the secret rotates: %v, want INVALID_STATE", err)
		}
	}
	if err := secretOp(rotation.PhaseRetire, nil); err != nil {
		t.Fatal(err)
	}
	opens("retire", nextSecret)
	if _, err := ca.Load(dir, secret); errs.CodeOf(err) != errs.InvalidConfig {
		t.Fatalf("the old secret after retire: %v, want INVALID_CONFIG", err)
	}
	for _, name := range ca.KeyFiles {
		for _, suffix := range []string{ca.SuffixNext, ca.SuffixPrev} {
			if _, err := os.Stat(filepath.Join(dir, name) + suffix); err == nil {
				t.Fatalf("%s%s left behind", name, suffix)
			}
		}
	}
	// Keys rotate again, under the new secret.
	if _, err := rotation.Rotate(ctx, db, base, nextSecret, rotation.Op{Kind: ca.KindJoinSigning, Phase: rotation.PhaseRetire, Now: now}); err != nil {
		t.Fatal(err)
	}
}
