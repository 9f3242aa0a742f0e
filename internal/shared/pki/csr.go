package pki

import (
	"bytes"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/sha256"
	"crypto/sha512"
	"encoding/asn1"
	"unicode/utf8"

	"golang.org/x/crypto/cryptobyte"
	cbasn1 "golang.org/x/crypto/cryptobyte/asn1"

	"github.com/better-compute/better-compute/internal/shared/errs"
)

// DER contents of the object identifiers ParseCSR looks for (RFC 5480,
// RFC 5758), and the PKCS #9 extensionRequest attribute (RFC 2985).
var (
	derOIDKeyECPublicKey     = []byte{0x2a, 0x86, 0x48, 0xce, 0x3d, 0x02, 0x01}
	derOIDCurveP256          = []byte{0x2a, 0x86, 0x48, 0xce, 0x3d, 0x03, 0x01, 0x07}
	derOIDSigECDSAWithSHA256 = []byte{0x2a, 0x86, 0x48, 0xce, 0x3d, 0x04, 0x03, 0x02}
	derOIDSigECDSAWithSHA384 = []byte{0x2a, 0x86, 0x48, 0xce, 0x3d, 0x04, 0x03, 0x03}
	derOIDSigECDSAWithSHA512 = []byte{0x2a, 0x86, 0x48, 0xce, 0x3d, 0x04, 0x03, 0x04}
	oidAttrExtensionRequest  = asn1.ObjectIdentifier{1, 2, 840, 113549, 1, 9, 14}
	oidExtSubjectAltName     = asn1.ObjectIdentifier{2, 5, 29, 17}
)

const (
	tagCSRAttributes = cbasn1.Tag(0) | 0x20 | 0x80 // [0] IMPLICIT, constructed
	tagSANEmail      = cbasn1.Tag(1) | 0x80
	tagSANDNS        = cbasn1.Tag(2) | 0x80
	tagSANURI        = cbasn1.Tag(6) | 0x80
	tagSANIP         = cbasn1.Tag(7) | 0x80
)

// The messages ParseCSR answers with (on field "csr").
const (
	msgCSRNotPKCS10 = "not a PKCS#10 request"
	msgCSRSignature = "the signature does not verify"
	msgCSRKey       = "the key must be ECDSA P-256"
)

// parseCSR is ParseCSR after the size bound: a strict PKCS#10 (RFC 2986)
// parser over cryptobyte, in place of x509.ParseCertificateRequest and
// CheckSignature, whose reflection-based encoding/asn1 cost as much CPU per
// join as the ECDSA verification itself.
//
//	CertificationRequest ::= SEQUENCE {
//	  certificationRequestInfo  SEQUENCE {  -- signed, kept raw
//	    version       INTEGER (0),
//	    subject       Name,
//	    subjectPKInfo SubjectPublicKeyInfo, -- id-ecPublicKey, namedCurve P-256
//	    attributes    [0] IMPLICIT SET OF Attribute },
//	  signatureAlgorithm  AlgorithmIdentifier, -- ecdsa-with-SHA256/384/512, no parameters
//	  signature           BIT STRING }
//
// DER throughout, nothing after any element. Only the key is used; the
// subject and the attributes are checked only so that everything accepted
// here is also accepted by crypto/x509 with the same key
// (FuzzParseCSR/FuzzParseCSRSigned hold the two to that). What is refused
// here that crypto/x509 would take: another version; signature algorithm
// parameters; ecdsa-with-SHA1 (CheckSignature allows SHA-1 in requests, and
// nothing of ours makes one); BIT STRINGs with unused bits; elements after
// the last one of a SEQUENCE; subject values other than PrintableString,
// UTF8String and IA5String; attributes that are not {OID, non-empty SET};
// more than one extensionRequest; URI SANs in a requested SAN extension
// (crypto/x509 parses them with net/url; we would have to do the same to
// refuse what it refuses). bcd's requests (identity.NewCSR: ecdsa-with-SHA256,
// an optional CN, no attributes) are none of these.
//
// Errors, as before: "not a PKCS#10 request" for any malformation (a point
// off the curve included), "the key must be ECDSA P-256" for a well-formed
// request with another key, "the signature does not verify" for another
// signature algorithm or a bad signature.
func parseCSR(der []byte) (*ecdsa.PublicKey, error) {
	fail := func(msg string) (*ecdsa.PublicKey, error) { return nil, errs.Invalid("csr", "%s", msg) }
	input := cryptobyte.String(der)
	var req, info cryptobyte.String
	if !input.ReadASN1(&req, cbasn1.SEQUENCE) || !input.Empty() ||
		!req.ReadASN1Element(&info, cbasn1.SEQUENCE) {
		return fail(msgCSRNotPKCS10)
	}
	// signatureAlgorithm: SEQUENCE { OID, parameters OPTIONAL }.
	var sigAlg, sigOID, param cryptobyte.String
	var paramTag cbasn1.Tag
	var sig []byte
	if !req.ReadASN1(&sigAlg, cbasn1.SEQUENCE) || !sigAlg.ReadASN1(&sigOID, cbasn1.OBJECT_IDENTIFIER) {
		return fail(msgCSRNotPKCS10)
	}
	sigParams := !sigAlg.Empty()
	if sigParams && (!sigAlg.ReadAnyASN1Element(&param, &paramTag) || !sigAlg.Empty()) ||
		!req.ReadASN1BitStringAsBytes(&sig) || !req.Empty() {
		return fail(msgCSRNotPKCS10)
	}

	body := info
	var version int64
	var subject, spki, attrs cryptobyte.String
	if !body.ReadASN1(&body, cbasn1.SEQUENCE) ||
		!body.ReadASN1Integer(&version) || version != 0 ||
		!body.ReadASN1(&subject, cbasn1.SEQUENCE) || !wellFormedName(subject) ||
		!body.ReadASN1(&spki, cbasn1.SEQUENCE) ||
		!body.ReadASN1(&attrs, tagCSRAttributes) || !wellFormedAttributes(attrs) ||
		!body.Empty() {
		return fail(msgCSRNotPKCS10)
	}
	// subjectPKInfo: SEQUENCE { SEQUENCE { OID, parameters OPTIONAL }, BIT STRING }.
	var keyAlg, keyOID cryptobyte.String
	var point []byte
	if !spki.ReadASN1(&keyAlg, cbasn1.SEQUENCE) || !keyAlg.ReadASN1(&keyOID, cbasn1.OBJECT_IDENTIFIER) ||
		!spki.ReadASN1BitStringAsBytes(&point) || !spki.Empty() {
		return fail(msgCSRNotPKCS10)
	}
	if !bytes.Equal(keyOID, derOIDKeyECPublicKey) {
		return fail(msgCSRKey)
	}
	// id-ecPublicKey takes a named curve (explicit parameters are
	// malformed, as in crypto/x509), and the curve must be P-256.
	var curve cryptobyte.String
	if !keyAlg.ReadASN1(&curve, cbasn1.OBJECT_IDENTIFIER) || !keyAlg.Empty() {
		return fail(msgCSRNotPKCS10)
	}
	if !bytes.Equal(curve, derOIDCurveP256) {
		return fail(msgCSRKey)
	}
	// SECURITY: an uncompressed point, on the curve, not the identity;
	// ParseUncompressedPublicKey checks all three.
	pub, err := ecdsa.ParseUncompressedPublicKey(elliptic.P256(), point)
	if err != nil {
		return fail(msgCSRNotPKCS10)
	}
	var digest []byte
	switch {
	case sigParams:
		// RFC 5758 §3.2: for ecdsa-with-SHA*, the parameters MUST be absent.
		return fail(msgCSRSignature)
	case bytes.Equal(sigOID, derOIDSigECDSAWithSHA256):
		d := sha256.Sum256(info)
		digest = d[:]
	case bytes.Equal(sigOID, derOIDSigECDSAWithSHA384):
		d := sha512.Sum384(info)
		digest = d[:]
	case bytes.Equal(sigOID, derOIDSigECDSAWithSHA512):
		d := sha512.Sum512(info)
		digest = d[:]
	default:
		return fail(msgCSRSignature)
	}
	if !ecdsa.VerifyASN1(pub, digest, sig) {
		return fail(msgCSRSignature)
	}
	return pub, nil
}

// wellFormedName checks the contents of a Name (RFC 5280 §4.1.2.4):
// SEQUENCE OF SET OF SEQUENCE { OID, value }, with each value a
// PrintableString, UTF8String or IA5String that encoding/asn1 would accept.
// It is never used; it is checked because crypto/x509 parses it and refuses
// a malformed one.
func wellFormedName(name cryptobyte.String) bool {
	for !name.Empty() {
		var rdn cryptobyte.String
		if !name.ReadASN1(&rdn, cbasn1.SET) {
			return false
		}
		for !rdn.Empty() {
			var atv, value cryptobyte.String
			var oid asn1.ObjectIdentifier
			var tag cbasn1.Tag
			if !rdn.ReadASN1(&atv, cbasn1.SEQUENCE) || !atv.ReadASN1ObjectIdentifier(&oid) ||
				!atv.ReadAnyASN1(&value, &tag) || !atv.Empty() {
				return false
			}
			switch tag {
			case cbasn1.PrintableString:
				for _, b := range value {
					if !printableStringByte(b) {
						return false
					}
				}
			case cbasn1.UTF8String:
				if !utf8.Valid(value) {
					return false
				}
			case cbasn1.IA5String:
				if !ascii(value) {
					return false
				}
			default:
				return false
			}
		}
	}
	return true
}

// printableStringByte is encoding/asn1's PrintableString alphabet, which
// also takes '*' and '&'.
func printableStringByte(b byte) bool {
	return 'a' <= b && b <= 'z' || 'A' <= b && b <= 'Z' || '0' <= b && b <= '9' ||
		'\'' <= b && b <= ')' || '+' <= b && b <= '/' ||
		b == ' ' || b == ':' || b == '=' || b == '?' || b == '*' || b == '&'
}

func ascii(b []byte) bool {
	for _, c := range b {
		if c >= utf8.RuneSelf {
			return false
		}
	}
	return true
}

// wellFormedAttributes checks the contents of a request's attributes
// (RFC 2986 §4.1): each SEQUENCE { OID, SET OF value (at least one) }; at
// most one extensionRequest (RFC 2985 §5.4.2), holding one SEQUENCE OF
// Extension with distinct ids and, when it asks for subjectAltName, SANs
// crypto/x509 would parse. The contents are never used.
func wellFormedAttributes(attrs cryptobyte.String) bool {
	extensionRequest := false
	for !attrs.Empty() {
		var attr, values cryptobyte.String
		var oid asn1.ObjectIdentifier
		if !attrs.ReadASN1(&attr, cbasn1.SEQUENCE) || !attr.ReadASN1ObjectIdentifier(&oid) ||
			!attr.ReadASN1(&values, cbasn1.SET) || !attr.Empty() || values.Empty() {
			return false
		}
		if !oid.Equal(oidAttrExtensionRequest) {
			for !values.Empty() {
				var v cryptobyte.String
				var tag cbasn1.Tag
				if !values.ReadAnyASN1Element(&v, &tag) {
					return false
				}
			}
			continue
		}
		var exts cryptobyte.String
		if extensionRequest || !values.ReadASN1(&exts, cbasn1.SEQUENCE) || !values.Empty() {
			return false
		}
		extensionRequest = true
		var seen []asn1.ObjectIdentifier
		for !exts.Empty() {
			var ext, value cryptobyte.String
			var id asn1.ObjectIdentifier
			var critical bool
			if !exts.ReadASN1(&ext, cbasn1.SEQUENCE) || !ext.ReadASN1ObjectIdentifier(&id) ||
				!ext.ReadOptionalASN1Boolean(&critical, cbasn1.BOOLEAN, false) ||
				!ext.ReadASN1(&value, cbasn1.OCTET_STRING) || !ext.Empty() {
				return false
			}
			for _, s := range seen {
				if s.Equal(id) {
					return false
				}
			}
			seen = append(seen, id)
			if id.Equal(oidExtSubjectAltName) && !wellFormedSANs(value) {
				return false
			}
		}
	}
	return true
}

// wellFormedSANs checks a requested subjectAltName the way crypto/x509's
// parseSANExtension does, except that it refuses URIs instead of parsing
// them.
func wellFormedSANs(value cryptobyte.String) bool {
	var names cryptobyte.String
	if !value.ReadASN1(&names, cbasn1.SEQUENCE) || !value.Empty() {
		return false
	}
	for !names.Empty() {
		var name cryptobyte.String
		var tag cbasn1.Tag
		if !names.ReadAnyASN1(&name, &tag) {
			return false
		}
		switch tag {
		case tagSANEmail, tagSANDNS:
			if !ascii(name) {
				return false
			}
		case tagSANURI:
			return false
		case tagSANIP:
			if len(name) != 4 && len(name) != 16 {
				return false
			}
		}
	}
	return true
}
