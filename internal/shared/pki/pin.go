package pki

import (
	"crypto"
	"crypto/sha256"
	"crypto/subtle"
	"crypto/x509"
	"encoding/base64"
	"fmt"
	"strings"
)

// PinPrefix starts every pin.
const PinPrefix = "sha256/"

// Pin returns "sha256/<base64 of SHA-256 of the SubjectPublicKeyInfo DER>" for
// pub. This is the one place pins are computed: bcd's config, the well-known
// document and `pki pins` all use it.
func Pin(pub crypto.PublicKey) (string, error) {
	der, err := x509.MarshalPKIXPublicKey(pub)
	if err != nil {
		return "", fmt.Errorf("marshal public key: %w", err)
	}
	return PinSPKI(der), nil
}

// PinSPKI returns the pin of a DER SubjectPublicKeyInfo.
func PinSPKI(spkiDER []byte) string {
	sum := sha256.Sum256(spkiDER)
	return PinPrefix + base64.StdEncoding.EncodeToString(sum[:])
}

// ValidPin reports whether s has the form of a pin.
func ValidPin(s string) bool {
	rest, ok := strings.CutPrefix(s, PinPrefix)
	if !ok {
		return false
	}
	b, err := base64.StdEncoding.DecodeString(rest)
	return err == nil && len(b) == sha256.Size
}

// PinMatches reports, in constant time, whether pub hashes to pin.
func PinMatches(pin string, pub crypto.PublicKey) bool {
	got, err := Pin(pub)
	if err != nil {
		return false
	}
	return subtle.ConstantTimeCompare([]byte(got), []byte(pin)) == 1
}
