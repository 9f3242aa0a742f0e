package ca

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"crypto/x509"
	"encoding/asn1"
	"errors"
	"math/big"
	"time"
	"unicode/utf8"

	"github.com/better-compute/better-compute/internal/shared/pki"
	"golang.org/x/crypto/cryptobyte"
	cbasn1 "golang.org/x/crypto/cryptobyte/asn1"
)

// Object identifiers of a node certificate (RFC 5280, RFC 5480, RFC 5758).
var (
	oidSigECDSAWithSHA256 = asn1.ObjectIdentifier{1, 2, 840, 10045, 4, 3, 2}
	oidKeyECPublicKey     = asn1.ObjectIdentifier{1, 2, 840, 10045, 2, 1}
	oidCurveP256          = asn1.ObjectIdentifier{1, 2, 840, 10045, 3, 1, 7}
	oidAttrOU             = asn1.ObjectIdentifier{2, 5, 4, 11}
	oidAttrCN             = asn1.ObjectIdentifier{2, 5, 4, 3}
	oidExtKeyUsage        = asn1.ObjectIdentifier{2, 5, 29, 15}
	oidExtExtKeyUsage     = asn1.ObjectIdentifier{2, 5, 29, 37}
	oidExtBasicCons       = asn1.ObjectIdentifier{2, 5, 29, 19}
	oidExtAuthorityKeyID  = asn1.ObjectIdentifier{2, 5, 29, 35}
	oidExtSubjectAltName  = asn1.ObjectIdentifier{2, 5, 29, 17}
	oidEKUServerAuth      = asn1.ObjectIdentifier{1, 3, 6, 1, 5, 5, 7, 3, 1}
	oidEKUClientAuth      = asn1.ObjectIdentifier{1, 3, 6, 1, 5, 5, 7, 3, 2}
)

// signNodeTBS assembles, signs and verifies a node certificate: the
// TBSCertificate x509.CreateCertificate builds for SignNodeCertKey's
// template (v3; serial; ecdsa-with-SHA256; issuer = ca's subject; validity;
// subject OU=bc-role:<role>, CN=<node>; pub; extensions key usage
// digitalSignature (critical), EKU serverAuth and clientAuth, basic
// constraints CA:false (critical), the CA's authority key id, the URI SANs,
// then, when stmtExt is not nil, the pki.OIDNodeStatements extension
// (non-critical, value stmtExt), as ExtraExtensions would append it) byte for byte
// (TestSignNodeCertMatchesCreateCertificate), signed once by caKey and
// verified once against ca's public key. x509.CreateCertificate would spend
// most of its time on reflection-based ASN.1 and on a second verification
// (its check that the signer behaved) on top of the one here.
//
// The node CA is ECDSA P-256 (the bundle refuses anything else); caKey must
// be its key.
func signNodeTBS(ca *x509.Certificate, caKey crypto.Signer, pub *ecdsa.PublicKey, serial *big.Int,
	p NodeCertParams, notBefore, notAfter time.Time, uris []string, stmtExt []byte) ([]byte, error) {
	caPub, ok := ca.PublicKey.(*ecdsa.PublicKey)
	if !ok || caPub.Curve != elliptic.P256() {
		return nil, errors.New("the node CA's key is not ECDSA P-256")
	}
	if !caPub.Equal(caKey.Public()) {
		return nil, errors.New("the signing key is not the node CA's key")
	}
	point, err := pub.Bytes()
	if err != nil {
		return nil, err
	}
	for _, u := range uris {
		for i := 0; i < len(u); i++ {
			if u[i] >= utf8.RuneSelf {
				return nil, errors.New("a URI SAN is not ASCII")
			}
		}
	}
	sigAlg := func(b *cryptobyte.Builder) {
		b.AddASN1(cbasn1.SEQUENCE, func(b *cryptobyte.Builder) { b.AddASN1ObjectIdentifier(oidSigECDSAWithSHA256) })
	}
	ext := func(b *cryptobyte.Builder, id asn1.ObjectIdentifier, critical bool, value func(*cryptobyte.Builder)) {
		b.AddASN1(cbasn1.SEQUENCE, func(b *cryptobyte.Builder) {
			b.AddASN1ObjectIdentifier(id)
			if critical {
				b.AddASN1Boolean(true)
			}
			b.AddASN1(cbasn1.OCTET_STRING, value)
		})
	}
	var tb cryptobyte.Builder
	tb.AddASN1(cbasn1.SEQUENCE, func(b *cryptobyte.Builder) {
		b.AddASN1(cbasn1.Tag(0).Constructed().ContextSpecific(), func(b *cryptobyte.Builder) { b.AddASN1Int64(2) })
		b.AddASN1BigInt(serial)
		sigAlg(b)
		b.AddBytes(ca.RawSubject)
		b.AddASN1(cbasn1.SEQUENCE, func(b *cryptobyte.Builder) {
			addASN1Time(b, notBefore)
			addASN1Time(b, notAfter)
		})
		b.AddASN1(cbasn1.SEQUENCE, func(b *cryptobyte.Builder) {
			addRDN(b, oidAttrOU, pki.RoleOUPrefix+p.Role)
			addRDN(b, oidAttrCN, p.NodeID)
		})
		b.AddASN1(cbasn1.SEQUENCE, func(b *cryptobyte.Builder) {
			b.AddASN1(cbasn1.SEQUENCE, func(b *cryptobyte.Builder) {
				b.AddASN1ObjectIdentifier(oidKeyECPublicKey)
				b.AddASN1ObjectIdentifier(oidCurveP256)
			})
			b.AddASN1BitString(point)
		})
		b.AddASN1(cbasn1.Tag(3).Constructed().ContextSpecific(), func(b *cryptobyte.Builder) {
			b.AddASN1(cbasn1.SEQUENCE, func(b *cryptobyte.Builder) {
				ext(b, oidExtKeyUsage, true, func(b *cryptobyte.Builder) {
					// digitalSignature: bit 0, seven unused bits.
					b.AddASN1(cbasn1.BIT_STRING, func(b *cryptobyte.Builder) { b.AddBytes([]byte{7, 0x80}) })
				})
				ext(b, oidExtExtKeyUsage, false, func(b *cryptobyte.Builder) {
					b.AddASN1(cbasn1.SEQUENCE, func(b *cryptobyte.Builder) {
						b.AddASN1ObjectIdentifier(oidEKUServerAuth)
						b.AddASN1ObjectIdentifier(oidEKUClientAuth)
					})
				})
				ext(b, oidExtBasicCons, true, func(b *cryptobyte.Builder) {
					b.AddASN1(cbasn1.SEQUENCE, func(*cryptobyte.Builder) {})
				})
				if len(ca.SubjectKeyId) > 0 {
					ext(b, oidExtAuthorityKeyID, false, func(b *cryptobyte.Builder) {
						b.AddASN1(cbasn1.SEQUENCE, func(b *cryptobyte.Builder) {
							b.AddASN1(cbasn1.Tag(0).ContextSpecific(), func(b *cryptobyte.Builder) { b.AddBytes(ca.SubjectKeyId) })
						})
					})
				}
				ext(b, oidExtSubjectAltName, false, func(b *cryptobyte.Builder) {
					b.AddASN1(cbasn1.SEQUENCE, func(b *cryptobyte.Builder) {
						for _, u := range uris {
							b.AddASN1(cbasn1.Tag(6).ContextSpecific(), func(b *cryptobyte.Builder) { b.AddBytes([]byte(u)) })
						}
					})
				})
				if stmtExt != nil {
					ext(b, pki.OIDNodeStatements, false, func(b *cryptobyte.Builder) { b.AddBytes(stmtExt) })
				}
			})
		})
	})
	tbs, err := tb.Bytes()
	if err != nil {
		return nil, err
	}
	digest := sha256.Sum256(tbs)
	sig, err := caKey.Sign(rand.Reader, digest[:], crypto.SHA256)
	if err != nil {
		return nil, err
	}
	// The one verification: the signer produced a valid signature.
	if !ecdsa.VerifyASN1(caPub, digest[:], sig) {
		return nil, errors.New("the node CA's signature does not verify")
	}
	var cb cryptobyte.Builder
	cb.AddASN1(cbasn1.SEQUENCE, func(b *cryptobyte.Builder) {
		b.AddBytes(tbs)
		sigAlg(b)
		b.AddASN1BitString(sig)
	})
	return cb.Bytes()
}

// addASN1Time adds t as encoding/asn1 does: UTCTime from 1950 to 2049,
// GeneralizedTime otherwise.
func addASN1Time(b *cryptobyte.Builder, t time.Time) {
	if y := t.Year(); y >= 1950 && y < 2050 {
		b.AddASN1UTCTime(t)
		return
	}
	b.AddASN1GeneralizedTime(t)
}

// addRDN adds a one-attribute RDN; the value is a PrintableString when every
// byte allows it, else a UTF8String (encoding/asn1's choice for a string).
func addRDN(b *cryptobyte.Builder, oid asn1.ObjectIdentifier, v string) {
	tag := cbasn1.Tag(asn1.TagPrintableString)
	for i := 0; i < len(v); i++ {
		if !printable(v[i]) {
			tag = cbasn1.UTF8String
			break
		}
	}
	if !utf8.ValidString(v) {
		b.SetError(errors.New("a subject attribute is not UTF-8"))
		return
	}
	b.AddASN1(cbasn1.SET, func(b *cryptobyte.Builder) {
		b.AddASN1(cbasn1.SEQUENCE, func(b *cryptobyte.Builder) {
			b.AddASN1ObjectIdentifier(oid)
			b.AddASN1(tag, func(b *cryptobyte.Builder) { b.AddBytes([]byte(v)) })
		})
	})
}

// printable reports whether c may appear in an ASN.1 PrintableString.
func printable(c byte) bool {
	return 'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' ||
		'\'' <= c && c <= ')' || '+' <= c && c <= '/' || c == ' ' || c == ':' || c == '=' || c == '?'
}
