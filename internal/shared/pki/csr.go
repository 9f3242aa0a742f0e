package pki

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/x509"
	"encoding/asn1"

	"golang.org/x/crypto/cryptobyte"
	cbasn1 "golang.org/x/crypto/cryptobyte/asn1"

	"github.com/better-compute/better-compute/internal/shared/errs"
)

// oidAttrExtensionRequest is the PKCS #9 extensionRequest attribute
// (RFC 2985 §5.4.2).
var oidAttrExtensionRequest = asn1.ObjectIdentifier{1, 2, 840, 113549, 1, 9, 14}

// tagCSRAttributes is the request's attributes: [0] IMPLICIT, constructed.
const tagCSRAttributes = cbasn1.Tag(0) | 0x20 | 0x80

// The messages ParseCSR answers with (on field "csr").
const (
	msgCSRNotPKCS10 = "not a PKCS#10 request"
	msgCSRSignature = "the signature does not verify"
	msgCSRKey       = "the key must be ECDSA P-256"
)

// csrSignatureAlgorithms are the signature algorithms ParseCSR takes.
// CheckSignature also takes ecdsa-with-SHA1 in requests; nothing of ours
// makes one.
var csrSignatureAlgorithms = map[x509.SignatureAlgorithm]bool{
	x509.ECDSAWithSHA256: true, x509.ECDSAWithSHA384: true, x509.ECDSAWithSHA512: true,
}

// parseCSR is ParseCSR after the size bound: x509.ParseCertificateRequest
// and CheckSignature, then the refusals of our own, each a request crypto/x509
// takes and we do not (TestParseCSRStricterThanX509 has one of each):
//
//   - the request: another version than 0; an element after the attributes
//     or after the signature; a signature BIT STRING with unused bits;
//   - the subject: a value other than a PrintableString, UTF8String or
//     IA5String (crypto/x509 checks the contents of these three);
//   - the attributes: one that is not {OID, non-empty SET}; more than one
//     extensionRequest; URI SANs in a requested subjectAltName;
//   - the key: anything but ECDSA P-256;
//   - the signature: algorithm parameters (RFC 5758 §3.2: for
//     ecdsa-with-SHA*, they MUST be absent); ecdsa-with-SHA1.
//
// bcd's requests (identity.NewCSR: ecdsa-with-SHA256, an optional CN, no
// attributes) are none of these. Only the key is used.
//
// Errors: "not a PKCS#10 request" for any malformation (a point off the
// curve included), "the key must be ECDSA P-256" for a well-formed request
// with another key, "the signature does not verify" for another signature
// algorithm or a bad signature.
func parseCSR(der []byte) (*ecdsa.PublicKey, error) {
	fail := func(msg string) (*ecdsa.PublicKey, error) { return nil, errs.Invalid("csr", "%s", msg) }
	csr, err := x509.ParseCertificateRequest(der)
	if err != nil {
		return fail(msgCSRNotPKCS10)
	}
	sigParams, ok := strictCSREnvelope(der)
	if !ok || csr.Version != 0 || len(csr.URIs) != 0 || !strictCSRInfo(csr.RawTBSCertificateRequest) {
		return fail(msgCSRNotPKCS10)
	}
	pub, ok := csr.PublicKey.(*ecdsa.PublicKey)
	if !ok || pub.Curve != elliptic.P256() {
		return fail(msgCSRKey)
	}
	if sigParams || !csrSignatureAlgorithms[csr.SignatureAlgorithm] || csr.CheckSignature() != nil {
		return fail(msgCSRSignature)
	}
	return pub, nil
}

// strictCSREnvelope walks the unsigned outside of a request crypto/x509
// has parsed: SEQUENCE { info, SEQUENCE { OID, parameters OPTIONAL },
// BIT STRING }. ok is false for a signature with unused bits or an element
// after it; sigParams reports parameters in the signature algorithm.
func strictCSREnvelope(der cryptobyte.String) (sigParams, ok bool) {
	var req, sigAlg cryptobyte.String
	var sig asn1.BitString
	if !der.ReadASN1(&req, cbasn1.SEQUENCE) || !req.SkipASN1(cbasn1.SEQUENCE) ||
		!req.ReadASN1(&sigAlg, cbasn1.SEQUENCE) || !sigAlg.SkipASN1(cbasn1.OBJECT_IDENTIFIER) ||
		!req.ReadASN1BitString(&sig) || sig.BitLength%8 != 0 || !req.Empty() {
		return false, false
	}
	return !sigAlg.Empty(), true
}

// strictCSRInfo walks the certificationRequestInfo crypto/x509 has parsed
// (RFC 2986 §4.1):
//
//	SEQUENCE { version INTEGER, subject Name, subjectPKInfo SEQUENCE,
//	           attributes [0] IMPLICIT SET OF Attribute }
//
// with nothing after the attributes, and checks the subject's value types
// and the attributes' shape.
func strictCSRInfo(info cryptobyte.String) bool {
	var body, subject, attrs cryptobyte.String
	return info.ReadASN1(&body, cbasn1.SEQUENCE) && body.SkipASN1(cbasn1.INTEGER) &&
		body.ReadASN1(&subject, cbasn1.SEQUENCE) && strictCSRSubject(subject) &&
		body.SkipASN1(cbasn1.SEQUENCE) &&
		body.ReadASN1(&attrs, tagCSRAttributes) && strictCSRAttributes(attrs) && body.Empty()
}

// strictCSRSubject checks that every value in a Name (SEQUENCE OF SET OF
// SEQUENCE { OID, value }) is a PrintableString, UTF8String or IA5String.
func strictCSRSubject(name cryptobyte.String) bool {
	for !name.Empty() {
		var rdn cryptobyte.String
		if !name.ReadASN1(&rdn, cbasn1.SET) {
			return false
		}
		for !rdn.Empty() {
			var atv, value cryptobyte.String
			var tag cbasn1.Tag
			if !rdn.ReadASN1(&atv, cbasn1.SEQUENCE) || !atv.SkipASN1(cbasn1.OBJECT_IDENTIFIER) ||
				!atv.ReadAnyASN1(&value, &tag) || !atv.Empty() {
				return false
			}
			if tag != cbasn1.PrintableString && tag != cbasn1.UTF8String && tag != cbasn1.IA5String {
				return false
			}
		}
	}
	return true
}

// strictCSRAttributes checks that each attribute is SEQUENCE { OID, SET OF
// value (at least one) } and that at most one is an extensionRequest.
func strictCSRAttributes(attrs cryptobyte.String) bool {
	extensionRequest := false
	for !attrs.Empty() {
		var attr, values cryptobyte.String
		var oid asn1.ObjectIdentifier
		if !attrs.ReadASN1(&attr, cbasn1.SEQUENCE) || !attr.ReadASN1ObjectIdentifier(&oid) ||
			!attr.ReadASN1(&values, cbasn1.SET) || !attr.Empty() || values.Empty() {
			return false
		}
		if oid.Equal(oidAttrExtensionRequest) {
			if extensionRequest {
				return false
			}
			extensionRequest = true
		}
	}
	return true
}
