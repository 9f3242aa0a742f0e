package pki

import (
	"bytes"
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/asn1"
	"net"
	"testing"

	"golang.org/x/crypto/cryptobyte"
	cbasn1 "golang.org/x/crypto/cryptobyte/asn1"
)

// supportedCSRAlgorithms are the signature algorithms ParseCSR takes.
var supportedCSRAlgorithms = map[x509.SignatureAlgorithm]bool{
	x509.ECDSAWithSHA256: true, x509.ECDSAWithSHA384: true, x509.ECDSAWithSHA512: true,
}

// csrSeeds are requests of every shape ParseCSR takes, by crypto/x509.
func csrSeeds(t testing.TB, key crypto.Signer) [][]byte {
	var seeds [][]byte
	for _, tmpl := range []*x509.CertificateRequest{
		{Subject: pkix.Name{CommonName: "fuzz"}},
		{},
		{SignatureAlgorithm: x509.ECDSAWithSHA384, Subject: pkix.Name{CommonName: "ü", Organization: []string{"o"}}},
		{SignatureAlgorithm: x509.ECDSAWithSHA512, DNSNames: []string{"a.example"}, EmailAddresses: []string{"a@example.com"},
			IPAddresses: []net.IP{{10, 0, 0, 1}}},
	} {
		seeds = append(seeds, x509CSR(t, key, tmpl))
	}
	return seeds
}

// canonicalCSROuter reports whether der is exactly SEQUENCE { the signed
// info, SEQUENCE { the algorithm's OID }, BIT STRING (no unused bits) }:
// the outer encoding ParseCSR takes. The outer part is not signed, so a
// fuzzer changes it freely; crypto/x509 takes more there (parameters,
// unused bits, elements after the signature) than ParseCSR does.
func canonicalCSROuter(t *testing.T, der []byte, csr *x509.CertificateRequest) bool {
	oid := map[x509.SignatureAlgorithm]asn1.ObjectIdentifier{x509.ECDSAWithSHA256: oidSigECDSAWithSHA256,
		x509.ECDSAWithSHA384: oidSigECDSAWithSHA384, x509.ECDSAWithSHA512: oidSigECDSAWithSHA512}[csr.SignatureAlgorithm]
	var b cryptobyte.Builder
	b.AddASN1(cbasn1.SEQUENCE, func(b *cryptobyte.Builder) {
		b.AddBytes(csr.RawTBSCertificateRequest)
		b.AddASN1(cbasn1.SEQUENCE, func(b *cryptobyte.Builder) {
			b.AddASN1ObjectIdentifier(oid)
		})
		b.AddASN1BitString(csr.Signature)
	})
	return bytes.Equal(mustBytes(t, &b), der)
}

// FuzzParseCSR: whatever bytes a daemon sends as its certificate request,
// ParseCSR never panics, and it agrees with crypto/x509 (R4.1, R4.4):
//   - whatever it accepts, x509.ParseCertificateRequest and CheckSignature
//     accept too, with the same key, a P-256 one;
//   - whatever those accept with a P-256 key, a signature algorithm
//     ParseCSR supports and the outer encoding ParseCSR takes, it accepts.
//
// The signed info can only come from the seeds here (a change to it breaks
// the signature); FuzzParseCSRSigned explores it.
func FuzzParseCSR(f *testing.F) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		f.Fatal(err)
	}
	for _, s := range csrSeeds(f, key) {
		f.Add(s)
	}
	f.Add([]byte{})
	f.Add([]byte{0x30, 0x82, 0xff, 0xff})
	f.Fuzz(func(t *testing.T, b []byte) {
		pub, err := ParseCSR(b)
		csr, xerr := x509.ParseCertificateRequest(b)
		if xerr == nil {
			xerr = csr.CheckSignature()
		}
		if err == nil {
			if pub.Curve != elliptic.P256() {
				t.Fatalf("accepted a key on %s", pub.Curve.Params().Name)
			}
			if xerr != nil {
				t.Fatalf("accepted a request crypto/x509 refuses: %v", xerr)
			}
			if !pub.Equal(csr.PublicKey) {
				t.Fatal("took another key than crypto/x509")
			}
			return
		}
		if xerr == nil && IsP256(csr.PublicKey) && supportedCSRAlgorithms[csr.SignatureAlgorithm] && canonicalCSROuter(t, b, csr) {
			t.Fatalf("refused a request crypto/x509 accepts: %v", err)
		}
	})
}

// fuzzCSRKey is the fixed key FuzzParseCSRSigned signs with, so that its
// corpus means the same on every run.
func fuzzCSRKey(t testing.TB) *ecdsa.PrivateKey {
	d := make([]byte, 32)
	d[31] = 7
	key, err := ecdsa.ParseRawPrivateKey(elliptic.P256(), d)
	if err != nil {
		t.Fatal(err)
	}
	return key
}

// FuzzParseCSRSigned explores the signed part of a request: the fuzzer
// chooses the certificationRequestInfo bytes, the test signs them with a
// fixed key (hash chosen by h) and assembles the request. Whatever ParseCSR
// accepts, crypto/x509 accepts with the same key (R4.1, R4.4). (The other
// way round does not hold here by design: ParseCSR is stricter than x509 in
// the info, see parseCSR and TestParseCSR.)
func FuzzParseCSRSigned(f *testing.F) {
	key := fuzzCSRKey(f)
	for i, s := range csrSeeds(f, key) {
		csr, err := x509.ParseCertificateRequest(s)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(csr.RawTBSCertificateRequest, uint8(i))
	}
	f.Add(newCSRInfo(f, key), uint8(0))
	hashes := []crypto.Hash{crypto.SHA256, crypto.SHA384, crypto.SHA512}
	oids := []asn1.ObjectIdentifier{oidSigECDSAWithSHA256, oidSigECDSAWithSHA384, oidSigECDSAWithSHA512}
	f.Fuzz(func(t *testing.T, info []byte, h uint8) {
		if len(info) > maxCSRSize {
			return
		}
		i := int(h) % len(hashes)
		d := hashes[i].New()
		d.Write(info)
		sig, err := ecdsa.SignASN1(rand.Reader, key, d.Sum(nil))
		if err != nil {
			t.Fatal(err)
		}
		var b cryptobyte.Builder
		b.AddASN1(cbasn1.SEQUENCE, func(b *cryptobyte.Builder) {
			b.AddBytes(info)
			b.AddASN1(cbasn1.SEQUENCE, func(b *cryptobyte.Builder) {
				b.AddASN1ObjectIdentifier(oids[i])
			})
			b.AddASN1BitString(sig)
		})
		der, err := b.Bytes()
		if err != nil || len(der) > maxCSRSize {
			return
		}
		pub, err := ParseCSR(der)
		if err != nil {
			return
		}
		if !pub.Equal(&key.PublicKey) {
			t.Fatal("accepted another key than the one that signed")
		}
		xpub, ok := x509Verdict(der)
		if !ok {
			_, xerr := x509.ParseCertificateRequest(der)
			t.Fatalf("accepted a request crypto/x509 refuses: %v", xerr)
		}
		if !pub.Equal(xpub) {
			t.Fatal("took another key than crypto/x509")
		}
	})
}

// newCSRInfo is the info of a request with every SAN type ParseCSR takes
// and a subject with each string type, for FuzzParseCSRSigned to start from.
func newCSRInfo(t testing.TB, key *ecdsa.PrivateKey) []byte {
	csr, err := x509.ParseCertificateRequest(x509CSR(t, key, &x509.CertificateRequest{
		Subject:        pkix.Name{CommonName: "n", Organization: []string{"o&*"}, SerialNumber: "ü"},
		EmailAddresses: []string{"a@b"}, DNSNames: []string{"a"}, IPAddresses: []net.IP{make(net.IP, 16)},
	}))
	if err != nil {
		t.Fatal(err)
	}
	return csr.RawTBSCertificateRequest
}
