package pki

import (
	"crypto"
	"crypto/sha256"
	"encoding/binary"
	"errors"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
)

// joinRequestDigestTag separates the join-request digest from every other
// hash the protocol takes.
const joinRequestDigestTag = "bc-join-request-v1"

// JoinRequestDigest is the SHA-256 that binds a whole join request end to
// end (R4.2): bcd puts it in the seal's protected header (or signs it, for
// attestors without a seal) and JoinService recomputes it from what
// arrived, so the gateway that relays the request can change nothing in it.
// It is also the key of the answer stored for the request (R4.9): the same
// request arriving again gets that answer back.
//
// It covers every field of the request except the seal itself, the
// signatures that are made over it (x509pop's sig, request_sig) and the
// answer to a challenge (see below). The encoding is
// explicit (a tag, then each field length-prefixed, lists with their
// count), not a protobuf serialization, so that two builds of bcd and the
// server agree byte for byte whatever their protobuf library does. A field
// added to JoinRequest must be added here.
func JoinRequestDigest(req *agentv1.JoinRequest) []byte {
	var b digestBuilder
	b.str(joinRequestDigestTag)
	b.u64(uint64(int64(req.GetProtocol())))
	b.str(req.GetAttestor())
	b.str(req.GetRole())
	b.str(req.GetNodeId())
	b.bytes(req.GetCsr())
	c := req.GetClaims()
	b.str(c.GetProductUuid())
	b.str(c.GetProductSerial())
	b.str(c.GetBoardSerial())
	b.str(c.GetChassisSerial())
	b.strs(c.GetMacs())
	b.strs(c.GetGpuUuids())
	b.str(c.GetHostname())
	pop := req.GetX509Pop()
	b.u64(uint64(len(pop.GetChain())))
	for _, der := range pop.GetChain() {
		b.bytes(der)
	}
	b.u64(uint64(pop.GetClientTimeUnixMs()))
	b.bytes(req.GetEvidence())
	// The challenge response's place, always empty: the answer is checked
	// against the attestor's own challenge, which is bound to this digest,
	// so an answer re-encoded by a relay must find the same stored answer
	// (R15.1) rather than count as a new request. Requests without an answer
	// hash as they always did.
	b.bytes(nil)
	b.bytes(req.GetKeyAttestation())
	sum := sha256.Sum256(b.buf)
	return sum[:]
}

// digestBuilder writes the length-prefixed encoding JoinRequestDigest hashes.
type digestBuilder struct{ buf []byte }

func (d *digestBuilder) u64(v uint64) { d.buf = binary.BigEndian.AppendUint64(d.buf, v) }

func (d *digestBuilder) bytes(v []byte) {
	d.u64(uint64(len(v)))
	d.buf = append(d.buf, v...)
}

func (d *digestBuilder) str(v string) {
	d.u64(uint64(len(v)))
	d.buf = append(d.buf, v...)
}

func (d *digestBuilder) strs(v []string) {
	d.u64(uint64(len(v)))
	for _, s := range v {
		d.str(s)
	}
}

// SignJoinRequest is the tpm attestor's request binding (R15.1): the node
// key (held in the TPM) signs the request digest under purpose tpm-join.
func SignJoinRequest(key crypto.Signer, reqDigest []byte) ([]byte, error) {
	if len(reqDigest) != sha256.Size {
		return nil, errReqDigestSize
	}
	return SignPurpose(key, PurposeTPMJoin, reqDigest)
}

// VerifyJoinRequest checks a SignJoinRequest signature under pub.
func VerifyJoinRequest(pub crypto.PublicKey, reqDigest, sig []byte) error {
	if len(reqDigest) != sha256.Size {
		return errReqDigestSize
	}
	return VerifyPurpose(pub, PurposeTPMJoin, reqDigest, sig)
}

var errReqDigestSize = errors.New("join request: the digest must be 32 bytes (JoinRequestDigest)")
