package ca

import (
	"crypto/x509"
	"encoding/pem"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/checks/tools"

	"github.com/spiffe/go-spiffe/v2/bundle/x509bundle"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"

	"github.com/better-compute/better-compute/internal/shared/pki"
)

// interopCerts are node certificates as JoinService issues them: a
// software-key node (no statement) and a TPM node (the AK statement) in
// each SVID form.
func interopCerts(t *testing.T, b *Bundle) map[string]*NodeCert {
	t.Helper()
	out := map[string]*NodeCert{}
	for name, edit := range map[string]func(*NodeCertParams){
		"software key":   func(*NodeCertParams) {},
		"tpm, page form": func(p *NodeCertParams) { p.Statements = []string{"urn:bc:tpm-ak:sha256:0a1b2c"} },
		"tpm, spiffe-strict": func(p *NodeCertParams) {
			p.Statements, p.StatementsInExtension = []string{"urn:bc:tpm-ak:sha256:0a1b2c"}, true
		},
		"software key strict": func(p *NodeCertParams) { p.StatementsInExtension = true },
	} {
		p := nodeParams()
		edit(&p)
		nc, err := SignNodeCert(b.NodeCA, b.NodeCAKey, newCSR(t, newP256(t)), p)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		out[name] = nc
	}
	return out
}

// R20.1: go-spiffe's X509-SVID verification, against an x509bundle of the
// node CA, accepts software-key node certificates and TPM node
// certificates in the strict form; the default ("page") form with a statement is the
// one it refuses (more than one URI SAN), which is why the option exists.
func TestNodeCertGoSPIFFEVerify(t *testing.T) {
	b := newBundle(t)
	td := spiffeid.RequireTrustDomainFromString(testTD)
	bundle := x509bundle.FromX509Authorities(td, []*x509.Certificate{b.NodeCA})
	certs := interopCerts(t, b)
	tests := []struct {
		name string
		ok   bool
	}{
		{"software key", true},
		{"software key strict", true},
		{"tpm, spiffe-strict", true},
		{"tpm, page form", false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			nc := certs[tt.name]
			id, chains, err := x509svid.Verify([]*x509.Certificate{nc.Cert}, bundle, x509svid.WithTime(t0.Add(time.Minute)))
			if !tt.ok {
				if err == nil || !strings.Contains(err.Error(), "more than one URI SAN") {
					t.Errorf("x509svid.Verify = %v, want the second URI SAN refused", err)
				}
				return
			}
			if err != nil {
				t.Fatalf("x509svid.Verify: %v", err)
			}
			if want := pki.SPIFFEID(testTD, "site_01k5w", "node_01k5x"); id.String() != want || len(chains) != 1 {
				t.Errorf("id %s (%d chains), want %s", id, len(chains), want)
			}
			// Our own parser reads the statement back in either form.
			got, err := pki.NodeIdentityOf(nc.Cert)
			if err != nil {
				t.Fatalf("NodeIdentityOf: %v", err)
			}
			if !slices.Equal(pki.CertStatements(nc.Cert), got.Statements) {
				t.Errorf("CertStatements %v, NodeIdentityOf %v", pki.CertStatements(nc.Cert), got.Statements)
			}
			if strings.HasPrefix(tt.name, "tpm") && (len(got.Statements) != 1 || got.Statements[0] != "urn:bc:tpm-ak:sha256:0a1b2c") {
				t.Errorf("statements %v", got.Statements)
			}
		})
	}
}

// R20.1: OpenSSL, a verifier nobody here wrote, accepts every node
// certificate for both TLS purposes against the node CA.
func TestNodeCertOpenSSLPurposes(t *testing.T) {
	bin := tools.Need(t, "openssl", "a verifier nobody here wrote")
	b := newBundle(t)
	dir := t.TempDir()
	caFile := filepath.Join(dir, "node-ca.pem")
	writePEM(t, caFile, b.NodeCA.Raw)
	// The node CA is valid from t0; verify at a time inside both
	// validities.
	at := t0.Add(time.Hour).Unix()
	for name, nc := range interopCerts(t, b) {
		leaf := filepath.Join(dir, strings.ReplaceAll(name, " ", "_")+".pem")
		writePEM(t, leaf, nc.DER)
		for _, purpose := range []string{"sslclient", "sslserver"} {
			t.Run(name+"/"+purpose, func(t *testing.T) {
				out, err := exec.Command(bin, "verify", "-attime", strconv.FormatInt(at, 10), "-purpose", purpose, "-CAfile", caFile, leaf).CombinedOutput()
				if err != nil || !strings.Contains(string(out), ": OK") {
					t.Errorf("openssl verify -purpose %s: %v\n%s", purpose, err, out)
				}
			})
		}
	}
}

func writePEM(t *testing.T, path string, der []byte) {
	t.Helper()
	if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
}
