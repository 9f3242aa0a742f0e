package ca

import (
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"net"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/pki"
)

// R3.1, R4.3: pki issue-gateway makes a serving certificate bcd verifies
// against the pinned serving CA, also usable as the gateway's client
// identity toward api.
func TestIssueGateway(t *testing.T) {
	b := newBundle(t)
	certPEM, keyPEM, err := IssueGateway(b, []string{"gw.eu.example.com", "10.0.0.7", "GW2.example.com"}, t0, 90*24*time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	pair, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		t.Fatalf("X509KeyPair: %v", err)
	}
	if len(pair.Certificate) != 2 {
		t.Fatalf("chain has %d certificates, want leaf and CA", len(pair.Certificate))
	}
	if kb, _ := pem.Decode(keyPEM); kb == nil || kb.Type != "PRIVATE KEY" {
		t.Errorf("key PEM type = %v", kb)
	}
	leaf, _ := x509.ParseCertificate(pair.Certificate[0])
	if ca, _ := x509.ParseCertificate(pair.Certificate[1]); !ca.Equal(b.ServingCA) {
		t.Error("second certificate is not the serving CA")
	}
	if diff := cmp.Diff([]string{"gw.eu.example.com", "gw2.example.com"}, leaf.DNSNames); diff != "" {
		t.Errorf("DNS SANs (-want +got):\n%s", diff)
	}
	if len(leaf.IPAddresses) != 1 || !leaf.IPAddresses[0].Equal(net.ParseIP("10.0.0.7")) {
		t.Errorf("IP SANs = %v", leaf.IPAddresses)
	}
	if !pki.IsP256(leaf.PublicKey) || leaf.IsCA || !leaf.NotAfter.Equal(t0.Add(90*24*time.Hour)) {
		t.Errorf("key/CA/NotAfter = %T %v %v", leaf.PublicKey, leaf.IsCA, leaf.NotAfter)
	}
	roots := x509.NewCertPool()
	roots.AddCert(b.ServingCA)
	for _, eku := range []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth} {
		if _, err := leaf.Verify(x509.VerifyOptions{Roots: roots, DNSName: "gw.eu.example.com", CurrentTime: t0, KeyUsages: []x509.ExtKeyUsage{eku}}); err != nil {
			t.Errorf("Verify for %v: %v", eku, err)
		}
	}
	// Not under the node CA: a gateway certificate is no node identity.
	nodeRoots := x509.NewCertPool()
	nodeRoots.AddCert(b.NodeCA)
	if _, err := leaf.Verify(x509.VerifyOptions{Roots: nodeRoots, CurrentTime: t0}); err == nil {
		t.Error("gateway certificate verified under the node CA")
	}
	if !pki.PinMatches(mustPins(t, b).ServingCA, b.ServingCA.PublicKey) {
		t.Error("serving CA pin mismatch")
	}
}

func mustPins(t *testing.T, b *Bundle) pki.Pins {
	t.Helper()
	p, err := b.Pins()
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// R3.1: bad SANs and lifetimes are INVALID_ARGUMENT.
func TestIssueGatewayRefusals(t *testing.T) {
	b := newBundle(t)
	tests := []struct {
		name  string
		sans  []string
		ttl   time.Duration
		field string
	}{
		{"no SAN", nil, time.Hour, "san"},
		{"URL", []string{"https://gw.example.com"}, time.Hour, "san"},
		{"space", []string{"gw example.com"}, time.Hour, "san"},
		{"empty label", []string{"gw..example.com"}, time.Hour, "san"},
		{"zero ttl", []string{"gw.example.com"}, 0, "ttl"},
		{"outlives CA", []string{"gw.example.com"}, 20 * 365 * 24 * time.Hour, "ttl"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, _, err := IssueGateway(b, tt.sans, t0, tt.ttl)
			e, ok := errs.As(err)
			if !ok || e.Code != errs.InvalidArgument || e.Field != tt.field {
				t.Errorf("err = %v, want INVALID_ARGUMENT on %s", err, tt.field)
			}
		})
	}
}
