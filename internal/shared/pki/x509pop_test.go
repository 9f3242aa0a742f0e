package pki

import (
	"testing"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
)

// R10.5, R4.2: x509pop evidence signs the digest of the whole request, so
// it verifies for that request only, under that key only, and never as
// another purpose's signature.
func TestX509PopSignsTheRequest(t *testing.T) {
	old := newP256(t)
	req := &agentv1.JoinRequest{
		Csr: newCSR(t, newP256(t)), Attestor: "x509pop", Role: RoleNode, NodeId: "node_01k5x", Protocol: 1,
		Claims:  &agentv1.Claims{Hostname: "h"},
		X509Pop: &agentv1.X509Pop{Chain: [][]byte{[]byte("leaf")}, ClientTimeUnixMs: t0.UnixMilli()},
	}
	digest := JoinRequestDigest(req)
	sig, err := SignX509Pop(old, digest)
	if err != nil {
		t.Fatal(err)
	}
	req.X509Pop.Sig = sig
	// The signature itself is not in the digest: signing does not change
	// what was signed.
	if string(JoinRequestDigest(req)) != string(digest) {
		t.Fatal("the digest covers the x509pop signature")
	}
	if err := VerifyX509Pop(&old.PublicKey, JoinRequestDigest(req), sig); err != nil {
		t.Fatalf("VerifyX509Pop: %v", err)
	}
	changed := func(edit func(r *agentv1.JoinRequest)) []byte {
		r := &agentv1.JoinRequest{
			Csr: req.Csr, Attestor: req.Attestor, Role: req.Role, NodeId: req.NodeId, Protocol: req.Protocol,
			Claims:  &agentv1.Claims{Hostname: "h"},
			X509Pop: &agentv1.X509Pop{Chain: [][]byte{[]byte("leaf")}, ClientTimeUnixMs: t0.UnixMilli(), Sig: sig},
		}
		edit(r)
		return JoinRequestDigest(r)
	}
	for name, c := range map[string]struct {
		pub    any
		digest []byte
	}{
		"another key":         {&newP256(t).PublicKey, digest},
		"another CSR":         {&old.PublicKey, changed(func(r *agentv1.JoinRequest) { r.Csr = newCSR(t, newP256(t)) })},
		"another node id":     {&old.PublicKey, changed(func(r *agentv1.JoinRequest) { r.NodeId = "node_01k5y" })},
		"another role":        {&old.PublicKey, changed(func(r *agentv1.JoinRequest) { r.Role = RoleSite })},
		"another client time": {&old.PublicKey, changed(func(r *agentv1.JoinRequest) { r.X509Pop.ClientTimeUnixMs++ })},
		"another chain":       {&old.PublicKey, changed(func(r *agentv1.JoinRequest) { r.X509Pop.Chain = [][]byte{[]byte("other")} })},
		"other claims":        {&old.PublicKey, changed(func(r *agentv1.JoinRequest) { r.Claims.Hostname = "i" })},
		"a short digest":      {&old.PublicKey, digest[:31]},
	} {
		if err := VerifyX509Pop(c.pub, c.digest, sig); err == nil {
			t.Errorf("%s: verified", name)
		}
	}
	// Another purpose over the same bytes does not verify as x509pop, and
	// x509pop evidence does not verify as a renewal proof.
	renewSig, err := SignPurpose(old, PurposeRenewPoP, X509PopMessage(digest))
	if err != nil {
		t.Fatal(err)
	}
	if VerifyX509Pop(&old.PublicKey, digest, renewSig) == nil {
		t.Error("a renew-pop signature verified as x509pop evidence")
	}
	if VerifyPurpose(&old.PublicKey, PurposeRenewPoP, X509PopMessage(digest), sig) == nil {
		t.Error("x509pop evidence verified as a renewal proof")
	}
	if _, err := SignX509Pop(old, nil); err == nil {
		t.Error("signed without a digest")
	}
}
