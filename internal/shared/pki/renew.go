package pki

import (
	"crypto"
	"crypto/sha256"
	"encoding/binary"
)

// RenewPoPMessage is the message a renewal's proof of possession signs
// (R13.1), under purpose renew-pop:
//
//	sha256(csr) (32 bytes) || node id (UTF-8) || client time (Unix ms, 8 bytes big-endian)
//
// The hash and the time have fixed lengths, so the node id between them is
// unambiguous. bcd (signing) and JoinService (verifying) both build it
// here, so the layout exists once.
func RenewPoPMessage(csrDER []byte, nodeID string, clientTimeMS int64) []byte {
	sum := sha256.Sum256(csrDER)
	m := make([]byte, 0, len(sum)+len(nodeID)+8)
	m = append(m, sum[:]...)
	m = append(m, nodeID...)
	return binary.BigEndian.AppendUint64(m, uint64(clientTimeMS))
}

// SignRenewPoP signs a renewal's proof of possession with the node's current
// key.
func SignRenewPoP(key crypto.Signer, csrDER []byte, nodeID string, clientTimeMS int64) ([]byte, error) {
	return SignPurpose(key, PurposeRenewPoP, RenewPoPMessage(csrDER, nodeID, clientTimeMS))
}

// VerifyRenewPoP checks a SignRenewPoP signature under pub, the presented
// leaf's key.
func VerifyRenewPoP(pub crypto.PublicKey, csrDER []byte, nodeID string, clientTimeMS int64, sig []byte) error {
	return VerifyPurpose(pub, PurposeRenewPoP, RenewPoPMessage(csrDER, nodeID, clientTimeMS), sig)
}
