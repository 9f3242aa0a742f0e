package ca

import (
	"crypto/x509"
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/pki"
)

// R3.1: pki init writes the CAs and the two JoinService keys; Load reads
// them back with the same secret.
func TestInitLoadRoundTrip(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "pki")
	secret := testSecret
	b, err := Init(dir, testTD, secret, t0)
	if err != nil {
		t.Fatalf("Init: %v", err)
	}
	got, err := Load(dir, secret)
	if err != nil {
		t.Fatalf("Load: %v", err)
	}
	if got.TrustDomain != testTD || !got.CreatedAt.Equal(t0) {
		t.Errorf("TrustDomain, CreatedAt = %q, %v", got.TrustDomain, got.CreatedAt)
	}
	for name, pair := range map[string][2]*x509.Certificate{
		"node CA":         {b.NodeCA, got.NodeCA},
		"serving CA":      {b.ServingCA, got.ServingCA},
		"command signing": {b.CommandSigningCert, got.CommandSigningCert},
		"join signing":    {b.JoinSigningCert, got.JoinSigningCert},
	} {
		if !pair[0].Equal(pair[1]) {
			t.Errorf("%s certificate differs after Load", name)
		}
	}
	if !b.JoinEncryptionKey.Equal(got.JoinEncryptionKey) || !publicKeyEqual(b.JoinSigningKey.Public(), got.JoinSigningKey.Public()) {
		t.Error("keys differ after Load")
	}
	wantPins, _ := b.Pins()
	gotPins, err := got.Pins()
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(wantPins, gotPins); diff != "" {
		t.Errorf("pins differ (-want +got):\n%s", diff)
	}
	for _, p := range []string{gotPins.ServingCA, gotPins.JoinSigning, gotPins.JoinEncryption} {
		if !pki.ValidPin(p) {
			t.Errorf("invalid pin %q", p)
		}
	}

	// Modes: dir 0700, keys 0600, public files 0644.
	fi, err := os.Stat(dir)
	if err != nil || fi.Mode().Perm() != 0o700 {
		t.Errorf("dir mode = %v, %v", fi.Mode().Perm(), err)
	}
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	if len(entries) != 11 {
		t.Errorf("bundle has %d files, want 11", len(entries))
	}
	for _, e := range entries {
		info, _ := e.Info()
		want := os.FileMode(0o644)
		if strings.HasSuffix(e.Name(), ".key") {
			want = 0o600
			raw, _ := os.ReadFile(filepath.Join(dir, e.Name()))
			if !strings.HasPrefix(string(raw), "-----BEGIN "+EncryptedKeyPEMType) {
				t.Errorf("%s is not encrypted", e.Name())
			}
		}
		if info.Mode().Perm() != want {
			t.Errorf("%s mode = %v, want %v", e.Name(), info.Mode().Perm(), want)
		}
	}
	var m Manifest
	raw, _ := os.ReadFile(filepath.Join(dir, FileManifest))
	if err := json.Unmarshal(raw, &m); err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(Manifest{Version: 1, TrustDomain: testTD, CreatedAt: t0}, m); diff != "" {
		t.Errorf("manifest (-want +got):\n%s", diff)
	}
	// Nothing temporary is left beside the bundle.
	siblings, _ := os.ReadDir(filepath.Dir(dir))
	if len(siblings) != 1 {
		t.Errorf("parent holds %d entries, want only the bundle", len(siblings))
	}
}

// R3.1: the generated certificates have the shapes the product relies on.
func TestGenerateShapes(t *testing.T) {
	b := newBundle(t)
	for _, tt := range []struct {
		cert *x509.Certificate
		cn   string
		ca   bool
	}{
		{b.NodeCA, "better-compute node CA " + testTD, true},
		{b.ServingCA, "better-compute serving CA " + testTD, true},
		{b.CommandSigningCert, "better-compute command signing " + testTD, false},
		{b.JoinSigningCert, "better-compute join signing " + testTD, false},
	} {
		c := tt.cert
		if c.Subject.CommonName != tt.cn || c.IsCA != tt.ca || !pki.IsP256(c.PublicKey) {
			t.Errorf("%s: CN %q IsCA %v", tt.cn, c.Subject.CommonName, c.IsCA)
		}
		if err := c.CheckSignatureFrom(c); tt.ca && err != nil {
			t.Errorf("%s: not self-signed: %v", tt.cn, err)
		}
		if tt.ca && (c.MaxPathLen != 0 || !c.MaxPathLenZero) {
			t.Errorf("%s: CA may sign intermediates", tt.cn)
		}
		if got := c.NotAfter.Sub(t0); got < 9*365*24*time.Hour {
			t.Errorf("%s: lifetime %v, want 10y", tt.cn, got)
		}
	}
}

// R3.1: secret and trust domain are checked, and an existing bundle is never
// overwritten.
func TestInitRefusals(t *testing.T) {
	base := t.TempDir()
	existing := filepath.Join(base, "existing")
	if _, err := initBundle(existing, testTD, testSecret, t0, 10); err != nil {
		t.Fatal(err)
	}
	before, _ := os.ReadFile(filepath.Join(existing, FileNodeCACert))
	file := filepath.Join(base, "file")
	if err := os.WriteFile(file, []byte("keep me"), 0o600); err != nil {
		t.Fatal(err)
	}
	nonEmpty := filepath.Join(base, "nonempty")
	if err := os.MkdirAll(nonEmpty, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(nonEmpty, "other"), []byte("keep me"), 0o600); err != nil {
		t.Fatal(err)
	}
	strong := string(testSecret)
	tests := []struct {
		name   string
		dir    string
		td     string
		secret string
		code   errs.Code
		msg    string
	}{
		{"no secret", filepath.Join(base, "a"), testTD, "", errs.InvalidConfig, "BETTER_COMPUTE_SECRET"},
		// a weak secret makes nothing.
		{"weak secret", filepath.Join(base, "i"), testTD, "a", errs.InvalidConfig, "BETTER_COMPUTE_SECRET is too weak (an estimated 0 bits; at least 128 are required)"},
		{"weak phrase", filepath.Join(base, "j"), testTD, "correct horse battery staple", errs.InvalidConfig, "generate one with better-compute pki generate-secret"},
		{"existing bundle", existing, testTD, strong, errs.AlreadyExists, "never overwrites"},
		{"existing file", file, testTD, strong, errs.AlreadyExists, "never overwrites"},
		{"non-empty dir", nonEmpty, testTD, strong, errs.AlreadyExists, "never overwrites"},
		{"spiffe URI", filepath.Join(base, "b"), "spiffe://" + testTD, strong, errs.InvalidArgument, "trustDomain"},
		{"upper case", filepath.Join(base, "c"), "Compute.Example.com", strong, errs.InvalidArgument, "trustDomain"},
		{"empty", filepath.Join(base, "d"), "", strong, errs.InvalidArgument, "trustDomain"},
		{"slash", filepath.Join(base, "e"), "a/b", strong, errs.InvalidArgument, "trustDomain"},
		{"space", filepath.Join(base, "f"), "a b", strong, errs.InvalidArgument, "trustDomain"},
		{"port", filepath.Join(base, "g"), "a.com:443", strong, errs.InvalidArgument, "trustDomain"},
		{"empty label", filepath.Join(base, "h"), "a..com", strong, errs.InvalidArgument, "trustDomain"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := initBundle(tt.dir, tt.td, []byte(tt.secret), t0, 10)
			if errs.CodeOf(err) != tt.code || !strings.Contains(err.Error(), tt.msg) {
				t.Errorf("err = %v, want %s containing %q", err, tt.code, tt.msg)
			}
		})
	}
	after, _ := os.ReadFile(filepath.Join(existing, FileNodeCACert))
	kept, _ := os.ReadFile(file)
	other, _ := os.ReadFile(filepath.Join(nonEmpty, "other"))
	if string(before) != string(after) || string(kept) != "keep me" || string(other) != "keep me" {
		t.Error("a refused Init changed existing files")
	}
	for _, name := range []string{"a", "b", "c", "d", "e", "f", "g", "h", "i", "j"} {
		if _, err := os.Stat(filepath.Join(base, name)); !os.IsNotExist(err) {
			t.Errorf("a refused Init left %s behind", name)
		}
	}
	entries, _ := os.ReadDir(base)
	if len(entries) != 3 {
		t.Errorf("base holds %d entries, want 3 (no temporary directories)", len(entries))
	}
}

// R3.1: an empty directory made beforehand is taken over.
func TestInitIntoEmptyDir(t *testing.T) {
	dir := t.TempDir()
	if _, err := initBundle(dir, testTD, testSecret, t0, 10); err != nil {
		t.Fatalf("Init into an empty dir: %v", err)
	}
	if _, err := Load(dir, testSecret); err != nil {
		t.Fatalf("Load: %v", err)
	}
}

// R3.1: Load refuses a wrong or missing secret and a missing bundle.
func TestLoadRefusals(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "pki")
	if _, err := initBundle(dir, testTD, testSecret, t0, 10); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name, dir, secret, msg string
	}{
		{"wrong secret", dir, "wrong", "wrong BETTER_COMPUTE_SECRET?"},
		{"no secret", dir, "", "BETTER_COMPUTE_SECRET is not set"},
		{"no bundle", filepath.Join(dir, "missing"), string(testSecret), "run better-compute pki init"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := Load(tt.dir, []byte(tt.secret))
			if errs.CodeOf(err) != errs.InvalidConfig || !strings.Contains(err.Error(), tt.msg) {
				t.Errorf("err = %v, want INVALID_CONFIG containing %q", err, tt.msg)
			}
		})
	}

	// A key swapped for another bundle's key is caught.
	other := filepath.Join(t.TempDir(), "other")
	if _, err := initBundle(other, testTD, testSecret, t0, 10); err != nil {
		t.Fatal(err)
	}
	raw, _ := os.ReadFile(filepath.Join(other, FileJoinSigningKey))
	if err := os.Chmod(filepath.Join(dir, FileJoinSigningKey), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, FileJoinSigningKey), raw, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := Load(dir, testSecret); errs.CodeOf(err) != errs.InvalidConfig || !strings.Contains(err.Error(), "does not hold the key") {
		t.Errorf("swapped key: err = %v", err)
	}
}

// R11.6: the well-known join section carries the keys and their pins.
func TestWellKnownJoin(t *testing.T) {
	b := newBundle(t)
	w, err := b.WellKnownJoin()
	if err != nil {
		t.Fatal(err)
	}
	pub, err := pki.ParseEncryptionJWK(w.EncryptionJWK)
	if err != nil {
		t.Fatal(err)
	}
	if !pki.PinMatches(w.EncryptionKeyPin, pub) {
		t.Error("encryption key does not match its pin")
	}
	if !pki.PinMatches(w.SigningKeyPin, b.JoinSigningKey.Public()) {
		t.Error("signing pin does not match the signing key")
	}
	raw, err := json.Marshal(w)
	if err != nil {
		t.Fatal(err)
	}
	var doc map[string]any
	_ = json.Unmarshal(raw, &doc)
	jwk := doc["encryptionJwk"].(map[string]any)
	if diff := cmp.Diff([]string{"crv", "kty", "x", "y"}, sortedKeys(jwk)); diff != "" || jwk["kty"] != "EC" || jwk["crv"] != "P-256" {
		t.Errorf("encryptionJwk = %v", jwk)
	}
	if len(b.SigningCertificateDER()) == 0 || !strings.HasPrefix(w.SigningCertificate, "MII") {
		t.Errorf("signingCertificate = %q", w.SigningCertificate)
	}
	if k := b.EncryptionJWK(); !k.IsPublic() || !k.Valid() {
		t.Error("EncryptionJWK is not a valid public JWK")
	}
}

func sortedKeys(m map[string]any) []string {
	var ks []string
	for k := range m {
		ks = append(ks, k)
	}
	slices.Sort(ks)
	return ks
}
