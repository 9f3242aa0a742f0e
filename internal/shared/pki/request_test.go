package pki

import (
	"bytes"
	"testing"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
)

// R4.2, R15.1: every field of a join request changes its digest, but the
// seal, the signatures made over the digest and the answer to a challenge
// (checked against the attestor's own challenge, which is bound to the
// digest). A field added to JoinRequest without a place in the digest
// fails here.
func TestJoinRequestDigestCoversEveryFieldR15_1(t *testing.T) {
	base := &agentv1.JoinRequest{
		Csr: []byte("csr"), Claims: &agentv1.Claims{ProductUuid: "u", ProductSerial: "s", BoardSerial: "b", ChassisSerial: "c",
			Macs: []string{"m"}, GpuUuids: []string{"g"}, Hostname: "h"},
		Attestor: "tpm", Role: "node", NodeId: "node_1", Protocol: 2, Evidence: []byte("ev"), KeyAttestation: []byte("ka"),
		X509Pop: &agentv1.X509Pop{Chain: [][]byte{[]byte("leaf")}, ClientTimeUnixMs: 5, Sig: []byte("sig")},
	}
	left := map[protoreflect.Name]bool{"sealed_token": true, "request_sig": true, "challenge_response": true, "sig": true}
	want := JoinRequestDigest(base)
	var check func(path string, m protoreflect.Message, root *agentv1.JoinRequest)
	check = func(path string, m protoreflect.Message, root *agentv1.JoinRequest) {
		fields := m.Descriptor().Fields()
		for i := 0; i < fields.Len(); i++ {
			fd := fields.Get(i)
			if fd.Message() != nil && !fd.IsList() {
				check(path+string(fd.Name())+".", m.Mutable(fd).Message(), root)
				continue
			}
			c := proto.CloneOf(root)
			cm := c.ProtoReflect()
			// Walk to the same message in the copy.
			for _, part := range bytes.Split([]byte(path), []byte(".")) {
				if len(part) > 0 {
					cm = cm.Mutable(cm.Descriptor().Fields().ByName(protoreflect.Name(part))).Message()
				}
			}
			switch {
			case fd.IsList() && fd.Kind() == protoreflect.StringKind:
				cm.Mutable(fd).List().Append(protoreflect.ValueOfString("x"))
			case fd.IsList():
				cm.Mutable(fd).List().Append(protoreflect.ValueOfBytes([]byte("x")))
			case fd.Kind() == protoreflect.StringKind:
				cm.Set(fd, protoreflect.ValueOfString(cm.Get(fd).String()+"x"))
			case fd.Kind() == protoreflect.BytesKind:
				cm.Set(fd, protoreflect.ValueOfBytes(append(append([]byte(nil), cm.Get(fd).Bytes()...), 'x')))
			case fd.Kind() == protoreflect.Int32Kind:
				cm.Set(fd, protoreflect.ValueOfInt32(int32(cm.Get(fd).Int())+1))
			case fd.Kind() == protoreflect.Int64Kind:
				cm.Set(fd, protoreflect.ValueOfInt64(cm.Get(fd).Int()+1))
			default:
				t.Fatalf("%s%s: a field kind (%v) this test cannot change", path, fd.Name(), fd.Kind())
			}
			changed := !bytes.Equal(JoinRequestDigest(c), want)
			if changed == left[fd.Name()] {
				t.Errorf("%s%s: digest changed %v, want %v", path, fd.Name(), changed, !left[fd.Name()])
			}
		}
	}
	check("", proto.CloneOf(base).ProtoReflect(), base)
}

// R15.1: the tpm join's request signature verifies only for its digest and
// key, under its own purpose.
func TestSignJoinRequestR15_1(t *testing.T) {
	key := newP256(t)
	d := JoinRequestDigest(&agentv1.JoinRequest{Csr: []byte("csr")})
	sig, err := SignJoinRequest(key, d)
	if err != nil {
		t.Fatal(err)
	}
	if err := VerifyJoinRequest(key.Public(), d, sig); err != nil {
		t.Fatal(err)
	}
	other := append([]byte(nil), d...)
	other[0] ^= 1
	if VerifyJoinRequest(key.Public(), other, sig) == nil {
		t.Fatal("verified for another digest")
	}
	if VerifyJoinRequest(newP256(t).Public(), d, sig) == nil {
		t.Fatal("verified under another key")
	}
	if VerifyX509Pop(key.Public(), d, sig) == nil {
		t.Fatal("a tpm-join signature verified as x509pop evidence")
	}
	if _, err := SignJoinRequest(key, d[:31]); err == nil {
		t.Fatal("signed a digest of the wrong size")
	}
}
