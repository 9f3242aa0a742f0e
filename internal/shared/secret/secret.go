// Package secret owns bearer credentials of the form <scheme>_<id>.<secret>
// (join tokens bcjt_jt_….…, API keys bck_key_….…): minting 256 random bits,
// parsing, and hashing. The control plane stores only SHA-256 of the secret,
// so a database dump cannot be replayed as credentials, and it compares in
// constant time. It also estimates the strength of operator passphrases
// (BETTER_COMPUTE_SECRET) and generates strong ones (strength.go).
package secret

import (
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base64"
	"strings"
)

// secretLen is the length of 32 bytes in unpadded base64url.
const secretLen = 43

// Mint returns a new secret (256 random bits, base64url without padding) and
// its SHA-256.
func Mint() (plain string, sum []byte) {
	var b [32]byte
	if _, err := rand.Read(b[:]); err != nil {
		panic("secret: crypto/rand failed: " + err.Error())
	}
	plain = base64.RawURLEncoding.EncodeToString(b[:])
	return plain, Hash(plain)
}

// Hash returns the SHA-256 stored for a secret.
func Hash(plain string) []byte {
	s := sha256.Sum256([]byte(plain))
	return s[:]
}

// Matches reports in constant time whether plain hashes to sum.
func Matches(plain string, sum []byte) bool {
	return subtle.ConstantTimeCompare(Hash(plain), sum) == 1
}

// Format renders the bearer form scheme_id.secret.
func Format(scheme, id, plain string) string {
	return scheme + "_" + id + "." + plain
}

// Parse splits a bearer credential of the given scheme into its id and
// secret. It checks only the shape; the caller checks the id's prefix.
func Parse(scheme, bearer string) (id, plain string, ok bool) {
	rest, found := strings.CutPrefix(strings.TrimSpace(bearer), scheme+"_")
	if !found {
		return "", "", false
	}
	id, plain, found = strings.Cut(rest, ".")
	if !found || id == "" || len(plain) != secretLen || len(id) > 64 {
		return "", "", false
	}
	// Strict: the last character carries 4 bits and 2 zero padding bits,
	// so 4 spellings would decode to the same 32 bytes. Only the canonical
	// one (the one Mint writes) is a secret; the others are refused here
	// rather than compared (they would hash differently anyway).
	if _, err := base64.RawURLEncoding.Strict().DecodeString(plain); err != nil {
		return "", "", false
	}
	return id, plain, true
}
