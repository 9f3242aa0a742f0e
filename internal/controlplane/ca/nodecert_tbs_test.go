package ca

import (
	"bytes"
	"crypto"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/shared/pki"
)

// R7.2, R7.3, R20.1: SignNodeCertKey assembles the certificate itself; its
// TBSCertificate is, byte for byte, what x509.CreateCertificate builds from
// the same template, and the certificate verifies under the node CA.
func TestSignNodeCertMatchesCreateCertificate(t *testing.T) {
	b := newBundle(t)
	tests := []struct {
		name   string
		edit   func(*NodeCertParams)
		noSKID bool
	}{
		{name: "node", edit: func(*NodeCertParams) {}},
		{name: "printable node id", edit: func(p *NodeCertParams) { p.NodeID = "node-01k5x" }},
		{name: "node-tenant with statements", edit: func(p *NodeCertParams) {
			p.Role, p.Statements = pki.RoleNodeTenant, []string{"urn:bc:tpm-ak:sha256:0a1b2c", "urn:bc:other:x"}
		}},
		{name: "ramdisk, odd seconds", edit: func(p *NodeCertParams) {
			p.Role, p.NotBefore, p.NotAfter = pki.RoleRamdisk, t0.Add(1500*time.Millisecond), t0.Add(time.Hour+time.Second)
		}},
		{name: "CA without a subject key id", edit: func(*NodeCertParams) {}, noSKID: true},
		{name: "strict form, statements", edit: func(p *NodeCertParams) {
			p.Statements, p.StatementsInExtension = []string{"urn:bc:tpm-ak:sha256:0a1b2c", "urn:bc:other:x"}, true
		}},
		{name: "strict form, no statement", edit: func(p *NodeCertParams) { p.StatementsInExtension = true }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ca := b.NodeCA
			if tt.noSKID {
				c := *ca
				c.SubjectKeyId = nil
				ca = &c
			}
			key := newP256(t)
			p := nodeParams()
			tt.edit(&p)
			nc, err := SignNodeCertKey(ca, b.NodeCAKey, &key.PublicKey, p)
			if err != nil {
				t.Fatalf("SignNodeCertKey: %v", err)
			}
			if err := nc.Cert.CheckSignatureFrom(b.NodeCA); err != nil {
				t.Errorf("the node CA's signature does not verify: %v", err)
			}
			tmpl := &x509.Certificate{
				SerialNumber:          nc.Cert.SerialNumber,
				Subject:               pkix.Name{CommonName: p.NodeID, OrganizationalUnit: []string{pki.RoleOUPrefix + p.Role}},
				NotBefore:             p.NotBefore.Truncate(time.Second),
				NotAfter:              p.NotAfter.Truncate(time.Second),
				KeyUsage:              x509.KeyUsageDigitalSignature,
				ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
				BasicConstraintsValid: true,
				URIs:                  nc.Cert.URIs,
			}
			if p.StatementsInExtension && len(p.Statements) > 0 {
				v, err := pki.MarshalNodeStatements(p.Statements)
				if err != nil {
					t.Fatal(err)
				}
				tmpl.ExtraExtensions = []pkix.Extension{{Id: pki.OIDNodeStatements, Value: v}}
			}
			der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, b.NodeCAKey)
			if err != nil {
				t.Fatal(err)
			}
			want, err := x509.ParseCertificate(der)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(nc.Cert.RawTBSCertificate, want.RawTBSCertificate) {
				t.Errorf("TBS differs from x509.CreateCertificate's:\n got %x\nwant %x", nc.Cert.RawTBSCertificate, want.RawTBSCertificate)
			}
			if nc.Cert.SignatureAlgorithm != want.SignatureAlgorithm {
				t.Errorf("signature algorithm %v, want %v", nc.Cert.SignatureAlgorithm, want.SignatureAlgorithm)
			}
		})
	}
}

// A signer that is not the node CA's key, or a CA that is not P-256, is
// refused before anything is signed.
func TestSignNodeCertWrongCAKey(t *testing.T) {
	b := newBundle(t)
	other := newBundle(t)
	key := newP256(t)
	if _, err := SignNodeCertKey(b.NodeCA, other.NodeCAKey, &key.PublicKey, nodeParams()); err == nil {
		t.Error("signed with a key that is not the node CA's")
	}
	ca := *b.NodeCA
	ca.PublicKey = mustP384(t).Public()
	if _, err := SignNodeCertKey(&ca, b.NodeCAKey, &key.PublicKey, nodeParams()); err == nil {
		t.Error("signed for a CA whose key is not P-256")
	}
}

// faultySigner is the node CA's key returning another key's signature.
type faultySigner struct {
	crypto.Signer
	other crypto.Signer
}

func (f faultySigner) Sign(r io.Reader, digest []byte, o crypto.SignerOpts) ([]byte, error) {
	return f.other.Sign(r, digest, o)
}

// The one verification catches a signer that returns a bad signature.
func TestSignNodeCertFaultySigner(t *testing.T) {
	b := newBundle(t)
	key := newP256(t)
	s := faultySigner{Signer: b.NodeCAKey, other: newP256(t)}
	if _, err := SignNodeCertKey(b.NodeCA, s, &key.PublicKey, nodeParams()); err == nil || !strings.Contains(err.Error(), "does not verify") {
		t.Errorf("err = %v, want the signature refused", err)
	}
}
