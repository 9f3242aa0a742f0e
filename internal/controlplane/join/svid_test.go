package join_test

import (
	"crypto/x509"
	"testing"

	"github.com/spiffe/go-spiffe/v2/bundle/x509bundle"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
)

// checkSVID checks, with go-spiffe, that leaf is an X509-SVID for want
// (R7.2); the chain check is in checkSVIDChain.
func checkSVID(t *testing.T, leaf *x509.Certificate, want string) {
	t.Helper()
	id, err := x509svid.IDFromCert(leaf)
	if err != nil {
		t.Fatalf("go-spiffe refuses the leaf: %v", err)
	}
	if id.String() != want {
		t.Errorf("go-spiffe reads %s, want %s", id, want)
	}
}

// checkSVIDChain verifies chain (leaf first) as an X509-SVID against the
// node CA with go-spiffe.
func checkSVIDChain(t *testing.T, td string, nodeCA *x509.Certificate, chain [][]byte) {
	t.Helper()
	trust, err := spiffeid.TrustDomainFromString(td)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := x509svid.ParseAndVerify(chain[:1], x509bundle.FromX509Authorities(trust, []*x509.Certificate{nodeCA})); err != nil {
		t.Errorf("go-spiffe does not verify the SVID: %v", err)
	}
}
