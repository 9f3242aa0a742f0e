package ca

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/shared/pki"
)

// t0 is the fixed time tests run at.
var t0 = time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)

const testTD = "compute.example.com"

func newBundle(t testing.TB) *Bundle {
	t.Helper()
	b, err := Generate(testTD, t0)
	if err != nil {
		t.Fatalf("Generate: %v", err)
	}
	return b
}

func newP256(t testing.TB) *ecdsa.PrivateKey {
	t.Helper()
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

func newCSR(t testing.TB, key crypto.Signer) []byte {
	t.Helper()
	// The CSR asks for names of its own; SignNodeCert must ignore them.
	der, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{
		Subject:  pkix.Name{CommonName: "attacker", OrganizationalUnit: []string{"bc-role:site"}},
		DNSNames: []string{"evil.example.com"},
	}, key)
	if err != nil {
		t.Fatalf("CreateCertificateRequest: %v", err)
	}
	return der
}

func nodeParams() NodeCertParams {
	return NodeCertParams{
		TrustDomain: testTD,
		SiteID:      "site_01k5w",
		NodeID:      "node_01k5x",
		Role:        pki.RoleNode,
		NotBefore:   t0,
		NotAfter:    t0.Add(24 * time.Hour),
	}
}
