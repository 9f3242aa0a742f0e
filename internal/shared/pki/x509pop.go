package pki

import (
	"crypto"
	"crypto/sha256"
	"errors"
)

// X509PopMessage is the message the x509pop attestor's evidence signs
// (R10.5), under purpose x509pop, with the key of the expired node
// certificate: the join request's digest (JoinRequestDigest), 32 bytes.
//
// The digest covers the whole request but the signature itself: the CSR,
// the claims, the requested role and node id, the expired chain and the
// client time. So the signature binds everything the gateway relays (R4.2),
// and an identical request sent again carries an identical message, which
// is what lets JoinService hand back the answer it stored for it (R4.9).
// The purpose keeps a renewal proof from verifying as x509pop evidence and
// back. bcd (signing) and the attestor (verifying) both build it here.
func X509PopMessage(reqDigest []byte) []byte {
	return append([]byte(nil), reqDigest...)
}

// errDigestSize refuses a message that is not a request digest.
var errDigestSize = errors.New("x509pop: the request digest must be 32 bytes (JoinRequestDigest)")

// SignX509Pop signs x509pop evidence with the expired certificate's key over
// the request digest of the otherwise complete request.
func SignX509Pop(key crypto.Signer, reqDigest []byte) ([]byte, error) {
	if len(reqDigest) != sha256.Size {
		return nil, errDigestSize
	}
	return SignPurpose(key, PurposeX509Pop, X509PopMessage(reqDigest))
}

// VerifyX509Pop checks a SignX509Pop signature under pub, the expired
// leaf's key, for the request whose digest JoinService recomputed.
func VerifyX509Pop(pub crypto.PublicKey, reqDigest []byte, sig []byte) error {
	if len(reqDigest) != sha256.Size {
		return errDigestSize
	}
	return VerifyPurpose(pub, PurposeX509Pop, X509PopMessage(reqDigest), sig)
}
