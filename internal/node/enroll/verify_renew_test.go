package enroll

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/internal/controlplane/ca"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/ids"
	"github.com/better-compute/better-compute/internal/shared/pki"
)

// R13.1: a renewal answer is checked like a join answer, and must keep the
// node, site, trust domain and exactly the role (no node -> node-tenant as
// a hosted join may).
func TestVerifyRenewResponse(t *testing.T) {
	now := time.Now()
	b, err := ca.Generate("compute.example.com", now.Add(-time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	pins, err := b.Pins()
	if err != nil {
		t.Fatal(err)
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	csr, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{}, key)
	if err != nil {
		t.Fatal(err)
	}
	site, node := ids.New(ids.Site, now), ids.New(ids.Node, now)
	answer := func(t *testing.T, nodeID, role string) *agentv1.RenewResponse {
		t.Helper()
		nc, err := ca.SignNodeCert(b.NodeCA, b.NodeCAKey, csr, ca.NodeCertParams{TrustDomain: b.TrustDomain, SiteID: site, NodeID: nodeID, Role: role,
			NotBefore: now.Add(-time.Minute), NotAfter: now.Add(time.Hour)})
		if err != nil {
			t.Fatal(err)
		}
		body, err := proto.Marshal(&agentv1.JoinResponseBody{NodeId: nodeID, CertChain: [][]byte{nc.DER, b.NodeCA.Raw}, CommandBundle: [][]byte{b.CommandSigningCert.Raw},
			CsrSha256: pki.CSRHash(csr), TrustDomain: b.TrustDomain, SiteId: site, Role: role})
		if err != nil {
			t.Fatal(err)
		}
		sig, err := pki.SignResponse(b.JoinSigningKey, body)
		if err != nil {
			t.Fatal(err)
		}
		return &agentv1.RenewResponse{Body: body, Sig: sig, SigningCertificate: b.JoinSigningCert.Raw}
	}
	want := RenewExpectation{SigningPin: pins.JoinSigning, CSRHash: pki.CSRHash(csr), NodeKey: &key.PublicKey,
		TrustDomain: b.TrustDomain, SiteID: site, NodeID: node, Role: pki.RoleNode}
	other := ids.New(ids.Node, now.Add(time.Second))
	for _, tc := range []struct {
		name  string
		res   *agentv1.RenewResponse
		want  func(e *RenewExpectation)
		check Check
	}{
		{"accepted", answer(t, node, pki.RoleNode), nil, ""},
		{"another node", answer(t, other, pki.RoleNode), nil, CheckSPIFFEID},
		{"node lowered to node-tenant", answer(t, node, pki.RoleNodeTenant), nil, CheckRole},
		{"another trust domain expected", answer(t, node, pki.RoleNode), func(e *RenewExpectation) { e.TrustDomain = "other.example.com" }, CheckSPIFFEID},
		{"another CSR", answer(t, node, pki.RoleNode), func(e *RenewExpectation) { e.CSRHash = make([]byte, 32) }, CheckCSR},
		{"another signing pin", answer(t, node, pki.RoleNode), func(e *RenewExpectation) { e.SigningPin = pins.ServingCA }, CheckSignature},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := want
			if tc.want != nil {
				tc.want(&w)
			}
			body, err := VerifyRenewResponse(tc.res, w)
			if tc.check == "" {
				if err != nil || body.GetNodeId() != node {
					t.Fatalf("got %v, %v", body, err)
				}
				return
			}
			re, ok := err.(*ResponseError)
			if !ok || re.Check != tc.check || errs.CodeOf(err) != errs.Unauthenticated {
				t.Fatalf("got %v, want the %s check to fail", err, tc.check)
			}
			if !strings.Contains(err.Error(), "renewal response") || !strings.Contains(err.Error(), "current identity is kept") {
				t.Errorf("message %q does not speak of a renewal", err)
			}
		})
	}
}
