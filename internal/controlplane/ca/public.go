package ca

import (
	"crypto/ecdsa"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"

	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/pki"
)

// Public is the public half of a bundle: what `pki pins` and `daemon
// install-script` publish. Reading it needs no BETTER_COMPUTE_SECRET: pins are hashes of public keys, and asking for the secret to
// print them would spread the secret to every place that only needs pins.
//
// SECURITY: without the secret, LoadPublic cannot check that
// join-encryption.jwk holds the key of join-encryption.key (Load does, and
// the server refuses to start otherwise); it takes the JWK as the bundle's
// directory has it, which is what install scripts copy to machines.
type Public struct {
	TrustDomain string
	// ServingCA is pinned by bcd (serving_ca_spki_pin).
	ServingCA *ecdsa.PublicKey
	// JoinSigning is pinned by bcd (join_signing_key_pin).
	JoinSigning *ecdsa.PublicKey
	// JoinEncryption seals join tokens (join-encryption.jwk; pinned as
	// join_encryption_key_pin).
	JoinEncryption *ecdsa.PublicKey
}

// LoadPublic reads the public half of the bundle in dir: the manifest, the
// serving CA and join-signing certificates and join-encryption.jwk. No
// private key is read. Errors are errs.InvalidConfig, worded as Load's.
func LoadPublic(dir string) (*Public, error) {
	m, err := readManifest(dir)
	if err != nil {
		return nil, err
	}
	serving, err := loadCert(filepath.Join(dir, FileServingCACert))
	if err != nil {
		return nil, err
	}
	if !serving.IsCA {
		return nil, invalidConfig("%s is not a CA certificate", filepath.Join(dir, FileServingCACert))
	}
	signing, err := loadCert(filepath.Join(dir, FileJoinSigningCert))
	if err != nil {
		return nil, err
	}
	jwkPath := filepath.Join(dir, FileJoinEncryptionJWK)
	raw, err := os.ReadFile(jwkPath)
	if err != nil {
		return nil, invalidConfig("cannot read %s", jwkPath)
	}
	enc, err := pki.ParseEncryptionJWK(raw)
	if err != nil {
		return nil, invalidConfig("%s does not hold a join encryption key", jwkPath)
	}
	return &Public{TrustDomain: m.TrustDomain, ServingCA: serving.PublicKey.(*ecdsa.PublicKey),
		JoinSigning: signing.PublicKey.(*ecdsa.PublicKey), JoinEncryption: enc}, nil // loadCert checked P-256
}

// Pins returns the pins a bcd config carries, as Bundle.Pins does.
func (p *Public) Pins() (pki.Pins, error) {
	return pinsOf(p.ServingCA, p.JoinSigning, p.JoinEncryption)
}

// readManifest reads and checks dir's bundle.json.
func readManifest(dir string) (Manifest, error) {
	var m Manifest
	path := filepath.Join(dir, FileManifest)
	raw, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return m, invalidConfig("no PKI bundle in %s: run better-compute pki init", dir)
	}
	if err != nil {
		return m, fmt.Errorf("read manifest: %w", err)
	}
	if err := json.Unmarshal(raw, &m); err != nil {
		return m, invalidConfig("%s is not valid JSON", path)
	}
	if m.Version != BundleVersion {
		return m, invalidConfig("%s: unsupported bundle version %d", path, m.Version)
	}
	if err := pki.ValidateTrustDomain(m.TrustDomain); err != nil {
		return m, invalidConfig("%s: invalid trust domain %q", path, m.TrustDomain)
	}
	return m, nil
}

func invalidConfig(format string, args ...any) error {
	return errs.New(errs.InvalidConfig, format, args...)
}
