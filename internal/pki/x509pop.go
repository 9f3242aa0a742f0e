package pki

import (
	"crypto"
)

// X509PopMessage is the message the x509pop attestor's evidence signs
// (R10.5), under purpose x509pop, with the key of the expired node
// certificate: the join request's digest (JoinRequestDigest), which covers
// the CSR, the node id, the client time, the claims and everything else
// in the request, so the relay can change none of it. The purpose keeps a
// renewal proof from verifying as x509pop evidence and back. bcd (signing)
// and the attestor (verifying) both build it here.
func X509PopMessage(reqDigest []byte) []byte { return append([]byte(nil), reqDigest...) }

// SignX509Pop signs x509pop evidence with the expired certificate's key.
func SignX509Pop(key crypto.Signer, reqDigest []byte) ([]byte, error) {
	return SignPurpose(key, PurposeX509Pop, X509PopMessage(reqDigest))
}

// VerifyX509Pop checks a SignX509Pop signature under pub, the expired
// leaf's key.
func VerifyX509Pop(pub crypto.PublicKey, reqDigest, sig []byte) error {
	return VerifyPurpose(pub, PurposeX509Pop, X509PopMessage(reqDigest), sig)
}
