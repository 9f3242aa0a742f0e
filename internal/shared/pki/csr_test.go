package pki

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/asn1"
	"net"
	"net/url"
	"strings"
	"testing"

	"golang.org/x/crypto/cryptobyte"
	cbasn1 "golang.org/x/crypto/cryptobyte/asn1"

	"github.com/better-compute/better-compute/internal/shared/errs"
)

var (
	oidSigECDSAWithSHA1   = asn1.ObjectIdentifier{1, 2, 840, 10045, 4, 1}
	oidSigECDSAWithSHA384 = asn1.ObjectIdentifier{1, 2, 840, 10045, 4, 3, 3}
	oidSigECDSAWithSHA512 = asn1.ObjectIdentifier{1, 2, 840, 10045, 4, 3, 4}
)

// csrShape is a certificate request assembled by hand, to make requests
// crypto/x509 never would. Nil fields take the shape x509 gives them.
type csrShape struct {
	version   []byte // the INTEGER element
	subject   []byte // the Name element
	spki      []byte // the SubjectPublicKeyInfo element
	attrs     []byte // the [0] element
	infoExtra []byte // appended inside the info SEQUENCE
	sigAlg    []byte // the AlgorithmIdentifier element
	hash      crypto.Hash
	sig       func(sig []byte) []byte // the BIT STRING element from the signature
	trailing  []byte
}

func mustBytes(t testing.TB, b *cryptobyte.Builder) []byte {
	t.Helper()
	der, err := b.Bytes()
	if err != nil {
		t.Fatal(err)
	}
	return der
}

func der(t testing.TB, f func(b *cryptobyte.Builder)) []byte {
	t.Helper()
	var b cryptobyte.Builder
	f(&b)
	return mustBytes(t, &b)
}

func algID(t testing.TB, oid asn1.ObjectIdentifier, params []byte) []byte {
	return der(t, func(b *cryptobyte.Builder) {
		b.AddASN1(cbasn1.SEQUENCE, func(b *cryptobyte.Builder) {
			b.AddASN1ObjectIdentifier(oid)
			b.AddBytes(params)
		})
	})
}

func spkiOf(t testing.TB, alg []byte, point []byte, unusedBits byte) []byte {
	return der(t, func(b *cryptobyte.Builder) {
		b.AddASN1(cbasn1.SEQUENCE, func(b *cryptobyte.Builder) {
			b.AddBytes(alg)
			b.AddASN1(cbasn1.BIT_STRING, func(b *cryptobyte.Builder) {
				b.AddUint8(unusedBits)
				b.AddBytes(point)
			})
		})
	})
}

func bitString(t testing.TB, unusedBits byte, content []byte) []byte {
	return der(t, func(b *cryptobyte.Builder) {
		b.AddASN1(cbasn1.BIT_STRING, func(b *cryptobyte.Builder) {
			b.AddUint8(unusedBits)
			b.AddBytes(content)
		})
	})
}

// buildCSR signs s's info with key (the hash s.hash, SHA-256 by default)
// and assembles the request.
func buildCSR(t testing.TB, key *ecdsa.PrivateKey, s csrShape) []byte {
	t.Helper()
	if s.version == nil {
		s.version = []byte{0x02, 0x01, 0x00}
	}
	if s.subject == nil {
		s.subject = der(t, func(b *cryptobyte.Builder) {
			b.AddASN1(cbasn1.SEQUENCE, func(b *cryptobyte.Builder) { addRDN(b, oidAttrCN, "n") })
		})
	}
	if s.spki == nil {
		spki, err := x509.MarshalPKIXPublicKey(&key.PublicKey)
		if err != nil {
			t.Fatal(err)
		}
		s.spki = spki
	}
	if s.attrs == nil {
		s.attrs = []byte{0xa0, 0x00}
	}
	if s.hash == 0 {
		s.hash = crypto.SHA256
	}
	if s.sigAlg == nil {
		oid := map[crypto.Hash]asn1.ObjectIdentifier{crypto.SHA1: oidSigECDSAWithSHA1, crypto.SHA256: oidSigECDSAWithSHA256,
			crypto.SHA384: oidSigECDSAWithSHA384, crypto.SHA512: oidSigECDSAWithSHA512}[s.hash]
		s.sigAlg = algID(t, oid, nil)
	}
	if s.sig == nil {
		s.sig = func(sig []byte) []byte { return bitString(t, 0, sig) }
	}
	info := der(t, func(b *cryptobyte.Builder) {
		b.AddASN1(cbasn1.SEQUENCE, func(b *cryptobyte.Builder) {
			b.AddBytes(s.version)
			b.AddBytes(s.subject)
			b.AddBytes(s.spki)
			b.AddBytes(s.attrs)
			b.AddBytes(s.infoExtra)
		})
	})
	h := s.hash.New()
	h.Write(info)
	sig, err := ecdsa.SignASN1(rand.Reader, key, h.Sum(nil))
	if err != nil {
		t.Fatal(err)
	}
	return append(der(t, func(b *cryptobyte.Builder) {
		b.AddASN1(cbasn1.SEQUENCE, func(b *cryptobyte.Builder) {
			b.AddBytes(info)
			b.AddBytes(s.sigAlg)
			b.AddBytes(s.sig(sig))
		})
	}), s.trailing...)
}

func x509CSR(t testing.TB, key crypto.Signer, tmpl *x509.CertificateRequest) []byte {
	t.Helper()
	der, err := x509.CreateCertificateRequest(rand.Reader, tmpl, key)
	if err != nil {
		t.Fatalf("CreateCertificateRequest: %v", err)
	}
	return der
}

// x509Verdict is what crypto/x509 makes of a request: whether it parses
// and its signature checks, and the key.
func x509Verdict(der []byte) (crypto.PublicKey, bool) {
	csr, err := x509.ParseCertificateRequest(der)
	if err != nil || csr.CheckSignature() != nil {
		return nil, false
	}
	return csr.PublicKey, true
}

// R4.1, R4.4: JoinService takes the node key only from a well-formed,
// well-signed PKCS#10 request for an ECDSA P-256 key, and refuses anything
// else with INVALID_ARGUMENT on "csr". The x509 column says what
// crypto/x509 (which ParseCSR parses with) makes of the same bytes;
// ParseCSR never accepts what x509 refuses. The refusals of requests x509
// accepts are in TestParseCSRStricterThanX509.
func TestParseCSR(t *testing.T) {
	key := newP256(t)
	point, _ := key.PublicKey.Bytes()
	ecAlg := algID(t, oidKeyECPublicKey, der(t, func(b *cryptobyte.Builder) { b.AddASN1ObjectIdentifier(oidCurveP256) }))
	compressed := append([]byte{0x02 | point[64]&1}, point[1:33]...)
	offCurve := append([]byte(nil), point...)
	offCurve[64] ^= 1
	explicit := algID(t, oidKeyECPublicKey, der(t, func(b *cryptobyte.Builder) {
		// SpecifiedECDomain, abridged: crypto/x509 refuses any parameters
		// that are not a named curve.
		b.AddASN1(cbasn1.SEQUENCE, func(b *cryptobyte.Builder) { b.AddASN1Int64(1) })
	}))
	good := x509CSR(t, key, &x509.CertificateRequest{Subject: pkix.Name{CommonName: "n"}})
	badSig := append([]byte(nil), good...)
	badSig[len(badSig)-3] ^= 0x55

	const (
		malformed = "not a PKCS#10 request"
		signature = "the signature does not verify"
		wrongKey  = "the key must be ECDSA P-256"
	)
	tests := []struct {
		name string
		csr  []byte
		msg  string // "" accepts
		x509 bool   // crypto/x509 accepts
	}{
		// What crypto/x509 makes, with each hash CheckSignature takes.
		{"x509 SHA-256", x509CSR(t, key, &x509.CertificateRequest{SignatureAlgorithm: x509.ECDSAWithSHA256, Subject: pkix.Name{CommonName: "n"}}), "", true},
		{"x509 SHA-384", x509CSR(t, key, &x509.CertificateRequest{SignatureAlgorithm: x509.ECDSAWithSHA384}), "", true},
		{"x509 SHA-512", x509CSR(t, key, &x509.CertificateRequest{SignatureAlgorithm: x509.ECDSAWithSHA512}), "", true},
		{"x509 no subject (bcd without a hostname)", x509CSR(t, key, &x509.CertificateRequest{}), "", true},
		{"x509 names of its own (ignored, R7.2)", newCSR(t, key), "", true},
		{"x509 every SAN type but URIs", x509CSR(t, key, &x509.CertificateRequest{
			Subject:  pkix.Name{CommonName: "n", Organization: []string{"o&*"}, Country: []string{"DE"}, SerialNumber: "ü"},
			DNSNames: []string{"a.example"}, EmailAddresses: []string{"a@example.com"}, IPAddresses: []net.IP{{10, 0, 0, 1}, make(net.IP, 16)},
		}), "", true},
		{"hand-built SHA-256", buildCSR(t, key, csrShape{}), "", true},
		{"hand-built SHA-384", buildCSR(t, key, csrShape{hash: crypto.SHA384}), "", true},
		{"hand-built SHA-512", buildCSR(t, key, csrShape{hash: crypto.SHA512}), "", true},

		// Another key (crypto/x509 refuses a P-256 point on P-384; the
		// keys crypto/x509 takes and ParseCSR does not are in
		// TestParseCSRStricterThanX509).
		{"P-256 point under another curve's OID", buildCSR(t, key, csrShape{spki: spkiOf(t,
			algID(t, oidKeyECPublicKey, der(t, func(b *cryptobyte.Builder) { b.AddASN1ObjectIdentifier(asn1.ObjectIdentifier{1, 3, 132, 0, 34}) })), point, 0)}), malformed, false},

		// The key's encoding.
		{"compressed point", buildCSR(t, key, csrShape{spki: spkiOf(t, ecAlg, compressed, 0)}), malformed, false},
		{"point not on the curve", buildCSR(t, key, csrShape{spki: spkiOf(t, ecAlg, offCurve, 0)}), malformed, false},
		{"point at infinity", buildCSR(t, key, csrShape{spki: spkiOf(t, ecAlg, []byte{0}, 0)}), malformed, false},
		{"explicit curve parameters", buildCSR(t, key, csrShape{spki: spkiOf(t, explicit, point, 0)}), malformed, false},
		{"no curve", buildCSR(t, key, csrShape{spki: spkiOf(t, algID(t, oidKeyECPublicKey, nil), point, 0)}), malformed, false},
		{"key BIT STRING with unused bits", buildCSR(t, key, csrShape{spki: spkiOf(t, ecAlg, append(point, 0), 8-1)}), malformed, false},

		// The signature.
		{"bad signature", badSig, signature, false},
		{"signed by another key", buildCSR(t, key, csrShape{spki: func() []byte { s, _ := x509.MarshalPKIXPublicKey(&newP256(t).PublicKey); return s }()}), signature, false},
		{"hash other than labelled", buildCSR(t, key, csrShape{hash: crypto.SHA384, sigAlg: algID(t, oidSigECDSAWithSHA256, nil)}), signature, false},
		{"RSA signature algorithm", buildCSR(t, key, csrShape{sigAlg: algID(t, asn1.ObjectIdentifier{1, 2, 840, 113549, 1, 1, 11}, []byte{0x05, 0x00})}), signature, false},

		// The structure.
		{"trailing bytes", append(append([]byte(nil), good...), 0), malformed, false},
		{"trailing element", append(append([]byte(nil), good...), 0x05, 0x00), malformed, false},
		{"version not minimal", buildCSR(t, key, csrShape{version: []byte{0x02, 0x02, 0x00, 0x00}}), malformed, false},
		{"no attributes", buildCSR(t, key, csrShape{attrs: []byte{}}), malformed, false},
		{"subject not a SEQUENCE", buildCSR(t, key, csrShape{subject: []byte{0x31, 0x00}}), malformed, false},
		{"subject PrintableString with @", buildCSR(t, key, csrShape{subject: subjectOf(t, cbasn1.PrintableString, "a@b")}), malformed, false},
		{"subject UTF8String not UTF-8", buildCSR(t, key, csrShape{subject: subjectOf(t, cbasn1.UTF8String, "\xff")}), malformed, false},
		{"subject IA5String not ASCII", buildCSR(t, key, csrShape{subject: subjectOf(t, cbasn1.IA5String, "é")}), malformed, false},
		{"subject UTF8String", buildCSR(t, key, csrShape{subject: subjectOf(t, cbasn1.UTF8String, "ü")}), "", true},
		{"challengePassword attribute", buildCSR(t, key, csrShape{attrs: der(t, func(b *cryptobyte.Builder) {
			b.AddASN1(tagCSRAttributes, func(b *cryptobyte.Builder) {
				b.AddASN1(cbasn1.SEQUENCE, func(b *cryptobyte.Builder) {
					b.AddASN1ObjectIdentifier(asn1.ObjectIdentifier{1, 2, 840, 113549, 1, 9, 7})
					b.AddASN1(cbasn1.SET, func(b *cryptobyte.Builder) {
						b.AddASN1(cbasn1.UTF8String, func(b *cryptobyte.Builder) { b.AddBytes([]byte("pw")) })
					})
				})
			})
		})}), "", true},
		{"duplicate requested extensions", buildCSR(t, key, csrShape{attrs: extRequest(t, sanExt(tagSANDNS, []byte("a")), sanExt(tagSANDNS, []byte("b")))}), malformed, false},
		{"requested dNSName not ASCII", buildCSR(t, key, csrShape{attrs: extRequest(t, sanExt(tagSANDNS, []byte("é")))}), malformed, false},
		{"requested IP of 5 bytes", buildCSR(t, key, csrShape{attrs: extRequest(t, sanExt(tagSANIP, []byte{1, 2, 3, 4, 5}))}), malformed, false},
		{"requested extensions not a SEQUENCE", buildCSR(t, key, csrShape{attrs: der(t, func(b *cryptobyte.Builder) {
			b.AddASN1(tagCSRAttributes, func(b *cryptobyte.Builder) {
				b.AddASN1(cbasn1.SEQUENCE, func(b *cryptobyte.Builder) {
					b.AddASN1ObjectIdentifier(oidAttrExtensionRequest)
					b.AddASN1(cbasn1.SET, func(b *cryptobyte.Builder) { b.AddASN1Int64(1) })
				})
			})
		})}), malformed, false},
		{"garbage", []byte("not a csr"), malformed, false},
		{"empty", nil, "size", false},
		{"huge", make([]byte, maxCSRSize+1), "size", false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			pub, err := ParseCSR(tt.csr)
			xpub, xok := x509Verdict(tt.csr)
			if xok != tt.x509 {
				t.Errorf("crypto/x509 accepts: %v, want %v", xok, tt.x509)
			}
			if tt.msg == "" {
				if err != nil {
					t.Fatalf("ParseCSR: %v", err)
				}
				if !pub.Equal(xpub) || !pub.Equal(&key.PublicKey) {
					t.Fatal("ParseCSR returned another key")
				}
				return
			}
			e, ok := errs.As(err)
			if pub != nil || !ok || e.Code != errs.InvalidArgument || e.Field != "csr" || !strings.Contains(e.Message, tt.msg) {
				t.Fatalf("ParseCSR = %v, %v; want INVALID_ARGUMENT csr %q", pub, err, tt.msg)
			}
		})
	}
}

// subjectOf is a Name of one CN, of the string type tag.
func subjectOf(t testing.TB, tag cbasn1.Tag, v string) []byte {
	return der(t, func(b *cryptobyte.Builder) {
		b.AddASN1(cbasn1.SEQUENCE, func(b *cryptobyte.Builder) {
			b.AddASN1(cbasn1.SET, func(b *cryptobyte.Builder) {
				b.AddASN1(cbasn1.SEQUENCE, func(b *cryptobyte.Builder) {
					b.AddASN1ObjectIdentifier(oidAttrCN)
					b.AddASN1(tag, func(b *cryptobyte.Builder) { b.AddBytes([]byte(v)) })
				})
			})
		})
	})
}

// extRequestAttr adds one extensionRequest attribute holding exts.
func extRequestAttr(b *cryptobyte.Builder, exts ...func(*cryptobyte.Builder)) {
	b.AddASN1(cbasn1.SEQUENCE, func(b *cryptobyte.Builder) {
		b.AddASN1ObjectIdentifier(oidAttrExtensionRequest)
		b.AddASN1(cbasn1.SET, func(b *cryptobyte.Builder) {
			b.AddASN1(cbasn1.SEQUENCE, func(b *cryptobyte.Builder) {
				for _, e := range exts {
					e(b)
				}
			})
		})
	})
}

// extRequest is a request's attributes: one extensionRequest holding exts.
func extRequest(t testing.TB, exts ...func(*cryptobyte.Builder)) []byte {
	return der(t, func(b *cryptobyte.Builder) {
		b.AddASN1(tagCSRAttributes, func(b *cryptobyte.Builder) { extRequestAttr(b, exts...) })
	})
}

// sanExt is a subjectAltName extension of one name.
func sanExt(tag cbasn1.Tag, v []byte) func(*cryptobyte.Builder) {
	return func(b *cryptobyte.Builder) {
		b.AddASN1(cbasn1.SEQUENCE, func(b *cryptobyte.Builder) {
			b.AddASN1ObjectIdentifier(oidExtSubjectAltName)
			b.AddASN1(cbasn1.OCTET_STRING, func(b *cryptobyte.Builder) {
				b.AddASN1(cbasn1.SEQUENCE, func(b *cryptobyte.Builder) {
					b.AddASN1(tag, func(b *cryptobyte.Builder) { b.AddBytes(v) })
				})
			})
		})
	}
}

// oneAttribute is a request's attributes: one attribute of type oid with
// values (an empty SET when there are none).
func oneAttribute(t testing.TB, oid asn1.ObjectIdentifier, values ...[]byte) []byte {
	return der(t, func(b *cryptobyte.Builder) {
		b.AddASN1(tagCSRAttributes, func(b *cryptobyte.Builder) {
			b.AddASN1(cbasn1.SEQUENCE, func(b *cryptobyte.Builder) {
				b.AddASN1ObjectIdentifier(oid)
				b.AddASN1(cbasn1.SET, func(b *cryptobyte.Builder) {
					for _, v := range values {
						b.AddBytes(v)
					}
				})
			})
		})
	})
}

// R4.1, R4.4: the refusals ParseCSR adds after crypto/x509's parse, one
// row each (see parseCSR): requests that x509.ParseCertificateRequest and
// CheckSignature take (x509 column) and ParseCSR refuses. The one row
// x509 refuses is there for its message: a signature with unused bits is
// malformed, not a bad signature.
func TestParseCSRStricterThanX509(t *testing.T) {
	key := newP256(t)
	rsaKey, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		t.Fatal(err)
	}
	p384, _ := ecdsa.GenerateKey(elliptic.P384(), rand.Reader)
	_, edKey, _ := ed25519.GenerateKey(rand.Reader)
	u, _ := url.Parse("spiffe://example.com/x")
	oidChallengePassword := asn1.ObjectIdentifier{1, 2, 840, 113549, 1, 9, 7}
	twoExtRequests := der(t, func(b *cryptobyte.Builder) {
		b.AddASN1(tagCSRAttributes, func(b *cryptobyte.Builder) {
			extRequestAttr(b, sanExt(tagSANDNS, []byte("a")))
			extRequestAttr(b, func(b *cryptobyte.Builder) {
				b.AddASN1(cbasn1.SEQUENCE, func(b *cryptobyte.Builder) {
					b.AddASN1ObjectIdentifier(asn1.ObjectIdentifier{2, 5, 29, 15}) // keyUsage
					b.AddASN1(cbasn1.OCTET_STRING, func(b *cryptobyte.Builder) { b.AddBytes([]byte{0x03, 0x02, 0x07, 0x80}) })
				})
			})
		})
	})
	const (
		malformed = "not a PKCS#10 request"
		signature = "the signature does not verify"
		wrongKey  = "the key must be ECDSA P-256"
	)
	tests := []struct {
		name string
		csr  []byte
		msg  string
		x509 bool // crypto/x509 accepts
	}{
		{"version 1", buildCSR(t, key, csrShape{version: []byte{0x02, 0x01, 0x01}}), malformed, true},
		{"element after the attributes", buildCSR(t, key, csrShape{infoExtra: []byte{0x05, 0x00}}), malformed, true},
		{"element after the signature", buildCSR(t, key, csrShape{sig: func(sig []byte) []byte { return append(bitString(t, 0, sig), 0x05, 0x00) }}), malformed, true},
		{"signature BIT STRING with unused bits", buildCSR(t, key, csrShape{sig: func(sig []byte) []byte { return bitString(t, 1, append(sig, 0)) }}), malformed, false},
		{"subject T61String", buildCSR(t, key, csrShape{subject: subjectOf(t, cbasn1.T61String, "n")}), malformed, true},
		{"subject BMPString", buildCSR(t, key, csrShape{subject: subjectOf(t, cbasn1.Tag(30), "\x00n")}), malformed, true},
		{"attribute without values", buildCSR(t, key, csrShape{attrs: oneAttribute(t, oidChallengePassword)}), malformed, true},
		{"two extensionRequest attributes", buildCSR(t, key, csrShape{attrs: twoExtRequests}), malformed, true},
		{"requested URI SAN", x509CSR(t, key, &x509.CertificateRequest{URIs: []*url.URL{u}}), malformed, true},
		{"RSA key", newCSR(t, rsaKey), wrongKey, true},
		{"P-384 key", newCSR(t, p384), wrongKey, true},
		{"Ed25519 key", newCSR(t, edKey), wrongKey, true},
		{"signature algorithm parameters NULL", buildCSR(t, key, csrShape{sigAlg: algID(t, oidSigECDSAWithSHA256, []byte{0x05, 0x00})}), signature, true},
		{"ecdsa-with-SHA1", buildCSR(t, key, csrShape{hash: crypto.SHA1}), signature, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if _, xok := x509Verdict(tt.csr); xok != tt.x509 {
				t.Errorf("crypto/x509 accepts: %v, want %v", xok, tt.x509)
			}
			pub, err := ParseCSR(tt.csr)
			e, ok := errs.As(err)
			if pub != nil || !ok || e.Code != errs.InvalidArgument || e.Field != "csr" || !strings.Contains(e.Message, tt.msg) {
				t.Fatalf("ParseCSR = %v, %v; want INVALID_ARGUMENT csr %q", pub, err, tt.msg)
			}
		})
	}
}

// R4.4: every truncation of a good request is refused as malformed.
func TestParseCSRTruncated(t *testing.T) {
	good := x509CSR(t, newP256(t), &x509.CertificateRequest{Subject: pkix.Name{CommonName: "n"}, DNSNames: []string{"a"}})
	for n := 1; n < len(good); n++ {
		if pub, err := ParseCSR(good[:n]); err == nil || pub != nil || !strings.Contains(err.Error(), "not a PKCS#10 request") {
			t.Fatalf("ParseCSR(first %d of %d bytes) = %v, %v", n, len(good), pub, err)
		}
	}
}

// The hashes parseCSR picks are the ones the OIDs name (a self-check of
// the test's own builder against crypto/x509).
func TestBuildCSRMatchesX509(t *testing.T) {
	key := newP256(t)
	for _, h := range []crypto.Hash{crypto.SHA256, crypto.SHA384, crypto.SHA512} {
		if _, ok := x509Verdict(buildCSR(t, key, csrShape{hash: h})); !ok {
			t.Errorf("crypto/x509 refuses the hand-built request with %v", h)
		}
	}
}

func BenchmarkParseCSR(b *testing.B) {
	csr := newCSR(b, newP256(b))
	b.ReportAllocs()
	for b.Loop() {
		if _, err := ParseCSR(csr); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkParseCSRx509 is what ParseCSR cost with crypto/x509, for
// comparison.
func BenchmarkParseCSRx509(b *testing.B) {
	csr := newCSR(b, newP256(b))
	b.ReportAllocs()
	for b.Loop() {
		if _, ok := x509Verdict(csr); !ok {
			b.Fatal("x509 refused")
		}
	}
}
