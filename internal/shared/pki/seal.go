package pki

import (
	"crypto/ecdsa"
	"crypto/sha256"
	"encoding/base64"
	"errors"
	"fmt"
	"time"
	"unicode/utf8"

	"github.com/go-jose/go-jose/v4"
)

const (
	// SealType is the protected "typ" header of a sealed join token.
	SealType = "bcjt+jwe"
	// MaxSealSize bounds the compact JWE Open accepts.
	MaxSealSize = 8 << 10
	// MaxSealedTokenSize bounds the sealed plaintext (the bearer token).
	MaxSealedTokenSize = 1 << 10
	// SealMaxAge is how long after its iat a seal is accepted (R4.2).
	SealMaxAge = 10 * time.Minute
	// SealMaxFuture is how far ahead of the server's clock a seal's iat may
	// be (R4.2). Without it, a seal dated ahead (by a machine whose clock
	// runs fast, or on purpose) would escape SealMaxAge for as long as it is
	// dated ahead: whoever relayed it could replay it for that long.
	SealMaxFuture = 5 * time.Minute
)

// CSRHash returns the SHA-256 of a CSR's DER: the seal's "csr" header (in
// base64url) and the join response's csr_sha256.
func CSRHash(csrDER []byte) []byte {
	sum := sha256.Sum256(csrDER)
	return sum[:]
}

// Seal encrypts token to encPub (the pinned JoinService encryption key, P-256)
// as a compact JWE: alg ECDH-ES+A256KW, enc A256GCM, protected header typ
// "bcjt+jwe", iat (unix seconds), csr (base64url, unpadded, of the SHA-256
// of csrDER) and req (base64url, unpadded, of reqDigest, the
// JoinRequestDigest of the request the seal travels in). The header is
// authenticated as AES-GCM additional data, so the gateway that relays the
// seal can neither read the token, nor move it to a CSR or a request of its
// own, nor change anything in the request it came with (R4.2).
//
// The request must be complete before it is sealed: the digest covers every
// field but the seal itself.
func Seal(encPub *ecdsa.PublicKey, token string, csrDER, reqDigest []byte, iat time.Time) (string, error) {
	if encPub == nil || !IsP256(encPub) {
		return "", errors.New("seal: the encryption key must be ECDSA P-256")
	}
	if token == "" || len(token) > MaxSealedTokenSize || !utf8.ValidString(token) {
		return "", fmt.Errorf("seal: the token must be 1 to %d bytes of UTF-8", MaxSealedTokenSize)
	}
	if len(csrDER) == 0 {
		return "", errors.New("seal: empty CSR")
	}
	if len(reqDigest) != sha256.Size {
		return "", fmt.Errorf("seal: the request digest must be %d bytes (JoinRequestDigest)", sha256.Size)
	}
	opts := (&jose.EncrypterOptions{}).
		WithType(SealType).
		WithHeader("iat", iat.Unix()).
		WithHeader("csr", base64.RawURLEncoding.EncodeToString(CSRHash(csrDER))).
		WithHeader("req", base64.RawURLEncoding.EncodeToString(reqDigest))
	enc, err := jose.NewEncrypter(jose.A256GCM, jose.Recipient{Algorithm: jose.ECDH_ES_A256KW, Key: encPub}, opts)
	if err != nil {
		return "", fmt.Errorf("make encrypter: %w", err)
	}
	obj, err := enc.Encrypt([]byte(token))
	if err != nil {
		return "", fmt.Errorf("encrypt token: %w", err)
	}
	compact, err := obj.CompactSerialize()
	if err != nil {
		return "", fmt.Errorf("serialize seal: %w", err)
	}
	return compact, nil
}
