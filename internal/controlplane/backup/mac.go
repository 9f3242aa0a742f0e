package backup

import (
	"crypto/hkdf"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/json"

	"golang.org/x/crypto/scrypt"

	"github.com/better-compute/better-compute/internal/shared/errs"
)

// An archive of Format 2 carries manifest.mac right after manifest.json:
// an HMAC-SHA256 of manifest.json's exact bytes under a key derived from
// BETTER_COMPUTE_SECRET. The manifest holds every other member's size and
// SHA-256, and a restore checks each member against it, so the MAC covers
// the whole archive. Without it, anyone who could write an archive could
// edit the database and recompute the manifest, and restore would take it
// (R23.2).
const (
	memberMAC = "manifest.mac"
	// macLabel separates this key from every other use of the secret.
	macLabel    = "better-compute backup mac v1"
	macAlg      = "HMAC-SHA256"
	macKDF      = "scrypt+HKDF-SHA256"
	maxMACBytes = 4 << 10
	macSaltLen  = 16
)

// The scrypt cost of the MAC key, as for the PKI's key files
// (ca.EncryptKey). SECURITY: an archive is kept apart from the secret;
// with a plain HKDF its MAC would let whoever holds a leaked archive test
// guesses at a passphrase secret millions of times faster than the
// encrypted keys beside it allow. The parameters are fixed by macLabel's
// version, never read from the archive.
const (
	macScryptN = 1 << 15
	macScryptR = 8
	macScryptP = 1
)

// macFile is manifest.mac.
type macFile struct {
	Alg  string `json:"alg"`
	KDF  string `json:"kdf"`
	Salt []byte `json:"salt"`
	MAC  []byte `json:"mac"`
}

// macKey derives the MAC key of one archive from the secret and the
// archive's salt.
func macKey(secret, salt []byte) ([]byte, error) {
	ikm, err := scrypt.Key(secret, salt, macScryptN, macScryptR, macScryptP, 32)
	if err != nil {
		return nil, err
	}
	return hkdf.Key(sha256.New, ikm, salt, macLabel, 32)
}

func manifestMAC(key, manifest []byte) []byte {
	m := hmac.New(sha256.New, key)
	m.Write(manifest)
	return m.Sum(nil)
}

// sealManifest returns manifest.mac for the manifest's bytes.
func sealManifest(manifest, secret []byte) ([]byte, error) {
	if len(secret) == 0 {
		return nil, errNoSecret()
	}
	salt := make([]byte, macSaltLen)
	if _, err := rand.Read(salt); err != nil {
		return nil, err
	}
	key, err := macKey(secret, salt)
	if err != nil {
		return nil, err
	}
	return json.Marshal(macFile{Alg: macAlg, KDF: macKDF, Salt: salt, MAC: manifestMAC(key, manifest)})
}

// checkManifestMAC checks manifest.mac (raw) over the manifest's bytes
// under secret, comparing in constant time.
func checkManifestMAC(manifest, raw, secret []byte) error {
	if len(secret) == 0 {
		return errs.New(errs.InvalidConfig, "BETTER_COMPUTE_SECRET is not set: set it to the secret the backup was taken under; the archive is authenticated under it")
	}
	var f macFile
	if err := json.Unmarshal(raw, &f); err != nil || f.Alg != macAlg || f.KDF != macKDF || len(f.Salt) != macSaltLen || len(f.MAC) != sha256.Size {
		return damaged("%s is not a MAC this binary knows", memberMAC)
	}
	key, err := macKey(secret, f.Salt)
	if err != nil {
		return err
	}
	if !hmac.Equal(manifestMAC(key, manifest), f.MAC) {
		return errs.Invalid("--in", "the backup archive does not verify under BETTER_COMPUTE_SECRET: it was altered after it was written, or taken under another secret")
	}
	return nil
}

// errNoSecret is the refusal to write an archive without a secret.
func errNoSecret() error {
	return errs.New(errs.InvalidConfig, "BETTER_COMPUTE_SECRET is not set: a backup is authenticated under it, as its keys are encrypted with it")
}

// errNoMAC is the refusal of an archive without manifest.mac.
func errNoMAC() error {
	return errs.Invalid("--unauthenticated", "the backup archive carries no MAC (written by an older release, or stripped of it), so nothing shows it is the archive backup wrote: restore it only if you know where it has been, with --unauthenticated")
}
