package pki

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/rand"
	"crypto/sha256"
	"errors"
	"fmt"
)

// Signature purposes. Every signature in the product goes through
// SignPurpose, over "better-compute <purpose> v1\x00" || message, so a
// signature made for one purpose never verifies for another.
const (
	// PurposeJoinResponse signs a JoinResponse body (R4.6).
	PurposeJoinResponse = "join-response"
	// PurposeRenewPoP is the renewal proof of possession (R13.1).
	PurposeRenewPoP = "renew-pop"
	// PurposeCommand signs commands to nodes (R12.3).
	PurposeCommand = "command"
	// PurposeX509Pop is the x509pop attestor's proof of possession of an
	// expired node certificate's key (R10.5).
	PurposeX509Pop = "x509pop"
	// PurposeTPMJoin is a TPM-held node key's signature over a tpm join's
	// request digest (R15.1).
	PurposeTPMJoin = "tpm-join"
)

// ErrSignature is returned (wrapped) when a signature does not verify.
var ErrSignature = errors.New("signature does not verify")

// signedMessage returns the domain-separated message for purpose. purpose is
// restricted to [a-z0-9-] so the prefix cannot be ambiguous.
func signedMessage(purpose string, msg []byte) ([]byte, error) {
	if purpose == "" || len(purpose) > 64 {
		return nil, fmt.Errorf("check purpose %q: invalid", purpose)
	}
	for i := 0; i < len(purpose); i++ {
		c := purpose[i]
		if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-') {
			return nil, fmt.Errorf("check purpose %q: invalid character", purpose)
		}
	}
	m := make([]byte, 0, len("better-compute ")+len(purpose)+len(" v1\x00")+len(msg))
	m = append(m, "better-compute "...)
	m = append(m, purpose...)
	m = append(m, " v1\x00"...)
	return append(m, msg...), nil
}

// SignPurpose signs msg for purpose with key, an ECDSA P-256 signer (a
// software key or one held in a TPM): ECDSA with SHA-256, ASN.1 DER
// signature, over "better-compute <purpose> v1\x00" || msg.
func SignPurpose(key crypto.Signer, purpose string, msg []byte) ([]byte, error) {
	if key == nil || !IsP256(key.Public()) {
		return nil, errors.New("sign: the key must be ECDSA P-256")
	}
	m, err := signedMessage(purpose, msg)
	if err != nil {
		return nil, err
	}
	digest := sha256.Sum256(m)
	sig, err := key.Sign(rand.Reader, digest[:], crypto.SHA256)
	if err != nil {
		return nil, fmt.Errorf("sign %s: %w", purpose, err)
	}
	return sig, nil
}

// VerifyPurpose checks a SignPurpose signature under pub (ECDSA P-256). It
// returns an error wrapping ErrSignature when the signature does not verify.
func VerifyPurpose(pub crypto.PublicKey, purpose string, msg, sig []byte) error {
	k, ok := pub.(*ecdsa.PublicKey)
	if !ok || !IsP256(k) {
		return errors.New("verify: the key must be ECDSA P-256")
	}
	m, err := signedMessage(purpose, msg)
	if err != nil {
		return err
	}
	digest := sha256.Sum256(m)
	if !ecdsa.VerifyASN1(k, digest[:], sig) {
		return fmt.Errorf("verify %s: %w", purpose, ErrSignature)
	}
	return nil
}

// SignResponse signs a JoinResponse body with the join-signing key (R4.6).
func SignResponse(key crypto.Signer, body []byte) ([]byte, error) {
	return SignPurpose(key, PurposeJoinResponse, body)
}

// VerifyResponse checks a JoinResponse signature under the pinned
// join-signing key; bcd checks it before anything else in the body.
func VerifyResponse(pub crypto.PublicKey, body, sig []byte) error {
	return VerifyPurpose(pub, PurposeJoinResponse, body, sig)
}
