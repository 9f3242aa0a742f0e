package jointest

import (
	"crypto"
	"testing"
	"time"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/internal/shared/pki"
)

// X509PopRequest returns what bcd sends to re-join with an expired
// certificate (R10.5): m's CSR and claims, attestor x509pop, node nodeID,
// and the evidence: chain (leaf first), clientTime, and the signature by
// old, the expired certificate's key, over the request's digest.
func (m *Machine) X509PopRequest(t testing.TB, old crypto.Signer, chain [][]byte, nodeID string, clientTime time.Time) *agentv1.JoinRequest {
	t.Helper()
	req := m.Request(t, nil, "", "")
	req.Attestor, req.NodeId = "x509pop", nodeID
	req.X509Pop = &agentv1.X509Pop{Chain: chain, ClientTimeUnixMs: clientTime.UnixMilli()}
	SignX509Pop(t, old, req)
	return req
}

// SignX509Pop (re)signs req's x509pop evidence with old over the digest of
// req as it is now, as bcd does once the request is complete (R4.2): a test
// that changes the request after X509PopRequest signs it again to reach
// the check it means.
func SignX509Pop(t testing.TB, old crypto.Signer, req *agentv1.JoinRequest) {
	t.Helper()
	sig, err := pki.SignX509Pop(old, pki.JoinRequestDigest(req))
	if err != nil {
		t.Fatal(err)
	}
	req.X509Pop.Sig = sig
}
