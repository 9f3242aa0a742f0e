package ca

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/better-compute/better-compute/internal/shared/errs"
)

// the public half of a bundle (pins, the encryption key)
// is read without the secret and without touching a private key file.
func TestLoadPublic(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "pki")
	b, err := initBundle(dir, testTD, testSecret, t0, 10)
	if err != nil {
		t.Fatal(err)
	}
	want, err := b.Pins()
	if err != nil {
		t.Fatal(err)
	}
	// No private key is read: the bundle works with every key file gone.
	matches, _ := filepath.Glob(filepath.Join(dir, "*.key"))
	if len(matches) != 5 {
		t.Fatalf("key files %v", matches)
	}
	for _, m := range matches {
		if err := os.Remove(m); err != nil {
			t.Fatal(err)
		}
	}
	pub, err := LoadPublic(dir)
	if err != nil {
		t.Fatal(err)
	}
	got, err := pub.Pins()
	if err != nil || got != want {
		t.Fatalf("pins %+v (%v), want %+v", got, err, want)
	}
	if pub.TrustDomain != testTD || !pub.JoinEncryption.Equal(&b.JoinEncryptionKey.PublicKey) {
		t.Fatalf("public %+v", pub)
	}

	other := filepath.Join(t.TempDir(), "other")
	if _, err := initBundle(other, testTD, testSecret, t0, 10); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name string
		edit func(t *testing.T, dir string)
		msg  string
	}{
		{"no bundle", func(t *testing.T, dir string) { os.Remove(filepath.Join(dir, FileManifest)) }, "no PKI bundle in "},
		{"jwk missing", func(t *testing.T, dir string) { os.Remove(filepath.Join(dir, FileJoinEncryptionJWK)) }, "cannot read "},
		{"jwk not a key", func(t *testing.T, dir string) {
			os.WriteFile(filepath.Join(dir, FileJoinEncryptionJWK), []byte(`{"kty":"oct"}`), 0o644)
		}, " does not hold a join encryption key"},
		{"serving CA is a leaf", func(t *testing.T, dir string) {
			raw, _ := os.ReadFile(filepath.Join(other, FileJoinSigningCert))
			os.WriteFile(filepath.Join(dir, FileServingCACert), raw, 0o644)
		}, " is not a CA certificate"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			d := filepath.Join(t.TempDir(), "pki")
			if _, err := initBundle(d, testTD, testSecret, t0, 10); err != nil {
				t.Fatal(err)
			}
			tt.edit(t, d)
			_, err := LoadPublic(d)
			e, ok := errs.As(err)
			if !ok || e.Code != errs.InvalidConfig || !strings.Contains(e.Message, tt.msg) {
				t.Fatalf("err = %v, want INVALID_CONFIG containing %q", err, tt.msg)
			}
		})
	}
}
