package pki

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/asn1"
	"strings"
	"testing"
	"time"

	"golang.org/x/crypto/cryptobyte"
	cbasn1 "golang.org/x/crypto/cryptobyte/asn1"
)

// t0 is the fixed time tests run at.
var t0 = time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)

const testTD = "compute.example.com"

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

func mustP384(t *testing.T) crypto.Signer {
	k, err := ecdsa.GenerateKey(elliptic.P384(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

// Object identifiers the CSR tests build requests with.
var (
	oidSigECDSAWithSHA256 = asn1.ObjectIdentifier{1, 2, 840, 10045, 4, 3, 2}
	oidKeyECPublicKey     = asn1.ObjectIdentifier{1, 2, 840, 10045, 2, 1}
	oidCurveP256          = asn1.ObjectIdentifier{1, 2, 840, 10045, 3, 1, 7}
	oidAttrCN             = asn1.ObjectIdentifier{2, 5, 4, 3}
	oidExtSubjectAltName  = asn1.ObjectIdentifier{2, 5, 29, 17}
)

// GeneralName tags (RFC 5280 §4.2.1.6) the CSR tests request SANs with.
const (
	tagSANDNS = cbasn1.Tag(2) | 0x80
	tagSANURI = cbasn1.Tag(6) | 0x80
	tagSANIP  = cbasn1.Tag(7) | 0x80
)

// addRDN adds one relative distinguished name, as a subject in a test
// request (PrintableString, or UTF8String when it does not fit).
func addRDN(b *cryptobyte.Builder, oid asn1.ObjectIdentifier, v string) {
	tag := cbasn1.Tag(asn1.TagPrintableString)
	for i := 0; i < len(v); i++ {
		c := v[i]
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || strings.IndexByte(" '()+,-./:=?", c) >= 0) {
			tag = cbasn1.UTF8String
			break
		}
	}
	b.AddASN1(cbasn1.SET, func(b *cryptobyte.Builder) {
		b.AddASN1(cbasn1.SEQUENCE, func(b *cryptobyte.Builder) {
			b.AddASN1ObjectIdentifier(oid)
			b.AddASN1(tag, func(b *cryptobyte.Builder) { b.AddBytes([]byte(v)) })
		})
	})
}
