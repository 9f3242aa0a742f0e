package pki

import (
	"crypto/ecdsa"
	"encoding/json"
	"fmt"

	"github.com/go-jose/go-jose/v4"

	"github.com/better-compute/better-compute/internal/shared/errs"
)

// maxJWKSize bounds a JWK file or document field.
const maxJWKSize = 4 << 10

// MarshalEncryptionJWK returns pub, a P-256 public key, as a JWK with kty,
// crv, x and y only: the form of /etc/bcd/join-encryption.jwk and of the
// well-known document's join.encryptionJwk.
func MarshalEncryptionJWK(pub *ecdsa.PublicKey) ([]byte, error) {
	if !IsP256(pub) {
		return nil, errs.New(errs.InvalidArgument, "the join encryption key must be an ECDSA P-256 public key")
	}
	data, err := json.Marshal(jose.JSONWebKey{Key: pub})
	if err != nil {
		return nil, fmt.Errorf("marshal jwk: %w", err)
	}
	return data, nil
}

// ParseEncryptionJWK parses a JWK that must be an EC P-256 public key. A JWK
// holding a private key ("d") is refused, as is one marked for signing or for
// another algorithm. The error is errs.InvalidConfig (the JWK is read from a
// config file or a document). Callers still compare the key with the pin
// (PinMatches) before trusting it.
func ParseEncryptionJWK(data []byte) (*ecdsa.PublicKey, error) {
	if len(data) > maxJWKSize {
		return nil, errs.New(errs.InvalidConfig, "the join encryption JWK is larger than %d bytes", maxJWKSize)
	}
	var jwk jose.JSONWebKey
	if err := jwk.UnmarshalJSON(data); err != nil {
		return nil, errs.New(errs.InvalidConfig, "the join encryption JWK is not a valid JWK")
	}
	// SECURITY: a private key never belongs in this file; refuse rather than
	// silently take its public half.
	pub, ok := jwk.Key.(*ecdsa.PublicKey)
	if !ok || !IsP256(pub) {
		return nil, errs.New(errs.InvalidConfig, "the join encryption JWK must be an EC P-256 public key")
	}
	if (jwk.Use != "" && jwk.Use != "enc") || (jwk.Algorithm != "" && jwk.Algorithm != string(jose.ECDH_ES_A256KW)) {
		return nil, errs.New(errs.InvalidConfig, "the join encryption JWK is not for %s encryption", jose.ECDH_ES_A256KW)
	}
	return pub, nil
}
