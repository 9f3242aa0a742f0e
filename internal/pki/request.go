package pki

import (
	"crypto/sha256"
	"encoding/binary"

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
// It covers every field of the request except the seal itself and
// signatures that are made over it (x509pop's sig). The encoding is
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
	b.bytes(req.GetChallengeResponse())
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
