package pki

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"testing"
)

// FuzzParseCSR: whatever bytes a daemon sends as its certificate request,
// ParseCSR never panics, and whatever it accepts is a P-256 key whose
// request verifies (R4.1, R4.4).
func FuzzParseCSR(f *testing.F) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		f.Fatal(err)
	}
	der, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{Subject: pkix.Name{CommonName: "fuzz"}}, key)
	if err != nil {
		f.Fatal(err)
	}
	f.Add(der)
	f.Add([]byte{})
	f.Add([]byte{0x30, 0x82, 0xff, 0xff})
	f.Fuzz(func(t *testing.T, b []byte) {
		pub, err := ParseCSR(b)
		if err != nil {
			return
		}
		if pub.Curve != elliptic.P256() {
			t.Fatalf("accepted a key on %s", pub.Curve.Params().Name)
		}
		csr, err := x509.ParseCertificateRequest(b)
		if err != nil || csr.CheckSignature() != nil {
			t.Fatalf("accepted a request that does not verify")
		}
	})
}
