package bcdconfig

import (
	"crypto/ecdsa"
	"errors"
	"io/fs"
	"path/filepath"

	"github.com/better-compute/better-compute/internal/shared/fsutil"

	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/pki"
)

// fixRotatedKey tells the operator how to repair join-encryption.jwk
// (R11.1): the install script writes the file and the pins together.
const fixRotatedKey = "after rotating the JoinService encryption key, generate the install script again (better-compute daemon install-script) and rerun it, which rewrites the file and the pins"

// LoadEncryptionKey reads the JoinService encryption key from
// dir/join-encryption.jwk, dir being config.toml's directory (R11.1).
//
//   - The file is missing: found is false and err nil; the join may then
//     fetch the key from the well-known document (only with --server).
//   - The file is present and its key hashes to pin: the key, found true.
//   - The file is present but unreadable, not a P-256 public JWK, or its key
//     does not match pin: an errs.InvalidConfig error saying how to fix it.
//     SECURITY: a present file that does not match never falls back to the
//     well-known document; it fails bcd join.
func LoadEncryptionKey(dir, pin string) (key *ecdsa.PublicKey, found bool, err error) {
	if !pki.ValidPin(pin) {
		return nil, false, errs.New(errs.InvalidConfig, "join_encryption_key_pin: want sha256/<base64 of a SHA-256>")
	}
	key, _, found, err = LoadEncryptionKeySet(dir, []string{pin})
	return key, found, err
}

// readEncryptionKey reads and parses dir/join-encryption.jwk; found is
// false (err nil) when the file is missing.
func readEncryptionKey(dir string) (*ecdsa.PublicKey, bool, error) {
	path := filepath.Join(dir, EncryptionKeyFile)
	data, err := readBounded(path, maxJWKFileSize)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, false, nil
	}
	if errors.Is(err, errTooLarge) {
		return nil, true, errs.New(errs.InvalidConfig, "%s: %v; %s", path, err, fixRotatedKey)
	}
	if err != nil {
		return nil, true, errs.Wrap(err, errs.InvalidConfig, "cannot read %s: %v", path, err)
	}
	pub, err := pki.ParseEncryptionJWK(data)
	if err != nil {
		msg := err.Error()
		if e, ok := errs.As(err); ok {
			msg = e.Message
		}
		return nil, true, errs.New(errs.InvalidConfig, "%s: %s; %s", path, msg, fixRotatedKey)
	}
	return pub, true, nil
}

// WriteEncryptionKey writes pub to dir/join-encryption.jwk atomically with
// mode 0644, after checking that it matches pin. `bcd join --server` on a
// host without config.toml writes it after the join (R11.3).
func WriteEncryptionKey(dir, pin string, pub *ecdsa.PublicKey) error {
	if !pki.PinMatches(pin, pub) {
		return errs.New(errs.InvalidConfig, "the join encryption key does not match join_encryption_key_pin")
	}
	data, err := pki.MarshalEncryptionJWK(pub)
	if err != nil {
		return err
	}
	return fsutil.WriteFileAtomic(filepath.Join(dir, EncryptionKeyFile), append(data, '\n'), 0o644)
}

// LoadEncryptionKeySet is LoadEncryptionKey for a pin set: the key in
// dir/join-encryption.jwk is accepted when it hashes to any pin of pins
// (during a rotation the file may hold the next key while an older one is
// still pinned, or the reverse), and pin is the one it matched.
func LoadEncryptionKeySet(dir string, pins []string) (key *ecdsa.PublicKey, pin string, found bool, err error) {
	if len(pins) == 0 {
		return nil, "", false, errs.New(errs.InvalidConfig, "join_encryption_key_pin: required")
	}
	for _, p := range pins {
		if !pki.ValidPin(p) {
			return nil, "", false, errs.New(errs.InvalidConfig, "join_encryption_key_pin: want sha256/<base64 of a SHA-256>")
		}
	}
	pub, found, err := readEncryptionKey(dir)
	if err != nil || !found {
		return nil, "", found, err
	}
	for _, p := range pins {
		if pki.PinMatches(p, pub) {
			return pub, p, true, nil
		}
	}
	return nil, "", true, errs.New(errs.InvalidConfig,
		"%s does not match join_encryption_key_pin: the key was rotated or the file is stale; %s", filepath.Join(dir, EncryptionKeyFile), fixRotatedKey)
}
