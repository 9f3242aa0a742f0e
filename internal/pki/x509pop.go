package pki

import (
	"crypto"
	"crypto/sha256"
	"encoding/binary"
)

// X509PopMessage is the message the x509pop attestor's evidence signs
// (R10.5), under purpose x509pop, with the key of the expired node
// certificate:
//
//	sha256(csr) (32 bytes) || node id (UTF-8) || client time (Unix ms, 8 bytes big-endian)
//
// The layout is RenewPoPMessage's; the purpose keeps a renewal proof from
// verifying as x509pop evidence and back. bcd (signing) and the attestor
// (verifying) both build it here.
func X509PopMessage(csrDER []byte, nodeID string, clientTimeMS int64) []byte {
	sum := sha256.Sum256(csrDER)
	m := make([]byte, 0, len(sum)+len(nodeID)+8)
	m = append(m, sum[:]...)
	m = append(m, nodeID...)
	return binary.BigEndian.AppendUint64(m, uint64(clientTimeMS))
}

// SignX509Pop signs x509pop evidence with the expired certificate's key.
func SignX509Pop(key crypto.Signer, csrDER []byte, nodeID string, clientTimeMS int64) ([]byte, error) {
	return SignPurpose(key, PurposeX509Pop, X509PopMessage(csrDER, nodeID, clientTimeMS))
}

// VerifyX509Pop checks a SignX509Pop signature under pub, the expired
// leaf's key.
func VerifyX509Pop(pub crypto.PublicKey, csrDER []byte, nodeID string, clientTimeMS int64, sig []byte) error {
	return VerifyPurpose(pub, PurposeX509Pop, X509PopMessage(csrDER, nodeID, clientTimeMS), sig)
}
