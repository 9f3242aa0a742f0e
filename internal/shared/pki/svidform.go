package pki

import (
	"crypto/x509"
	"encoding/asn1"
	"errors"
	"fmt"

	"golang.org/x/crypto/cryptobyte"
	cbasn1 "golang.org/x/crypto/cryptobyte/asn1"
)

// SVID forms: where a node certificate carries its urn:bc: statements
// (R20.1). Both forms have exactly one SPIFFE ID, the first URI SAN.
const (
	// SVIDFormPage is the first form, the default: each statement
	// is a further URI SAN after the SPIFFE ID. go-spiffe and Envoy refuse a
	// certificate with more than one URI SAN (X.509-SVID 5.2), so a node
	// with a statement (a certified tpm join) is not an SVID they accept.
	SVIDFormPage = "page"
	// SVIDFormStrict is the SPIFFE-strict form: the SPIFFE ID is the only
	// URI SAN and the statements travel in the non-critical
	// OIDNodeStatements extension, which relying parties that do not know
	// it ignore.
	SVIDFormStrict = "spiffe-strict"
)

// ValidSVIDForm reports whether form is one of SVIDFormPage and
// SVIDFormStrict ("" means SVIDFormPage).
func ValidSVIDForm(form string) bool {
	return form == "" || form == SVIDFormPage || form == SVIDFormStrict
}

// OIDNodeStatements is the extension of the SPIFFE-strict form: its value is
// a SEQUENCE OF IA5String, the statements in order. The arc is a private
// enterprise arc; every component fits in an int, so crypto/x509 (and so bcd
// and Go relying parties) parses the certificate (a UUID arc under 2.25
// would not).
var OIDNodeStatements = asn1.ObjectIdentifier{1, 3, 6, 1, 4, 1, 65535, 2020, 1}

// MarshalNodeStatements encodes statements as the value of the
// OIDNodeStatements extension.
func MarshalNodeStatements(statements []string) ([]byte, error) {
	var b cryptobyte.Builder
	b.AddASN1(cbasn1.SEQUENCE, func(b *cryptobyte.Builder) {
		for _, s := range statements {
			if !ValidStatement(s) {
				b.SetError(fmt.Errorf("%q is not a urn:bc: statement", s))
				return
			}
			b.AddASN1(cbasn1.IA5String, func(b *cryptobyte.Builder) { b.AddBytes([]byte(s)) })
		}
	})
	return b.Bytes()
}

// parseNodeStatements decodes an OIDNodeStatements extension value: at
// least one and at most MaxStatements valid statements, nothing trailing.
func parseNodeStatements(value []byte) ([]string, error) {
	in := cryptobyte.String(value)
	var seq cryptobyte.String
	if !in.ReadASN1(&seq, cbasn1.SEQUENCE) || !in.Empty() {
		return nil, errors.New("the statements extension is not a SEQUENCE")
	}
	var out []string
	for !seq.Empty() {
		var s cryptobyte.String
		if !seq.ReadASN1(&s, cbasn1.IA5String) {
			return nil, errors.New("a statement is not an IA5String")
		}
		if !ValidStatement(string(s)) {
			return nil, fmt.Errorf("%q is not a urn:bc: statement", string(s))
		}
		out = append(out, string(s))
	}
	if len(out) == 0 || len(out) > MaxStatements {
		return nil, fmt.Errorf("the statements extension holds %d statements, want 1 to %d", len(out), MaxStatements)
	}
	return out, nil
}

// statementsExtension returns the value of cert's OIDNodeStatements
// extension (nil when it has none), refusing a duplicate or critical one.
func statementsExtension(cert *x509.Certificate) ([]byte, error) {
	var value []byte
	for _, e := range cert.Extensions {
		if !e.Id.Equal(OIDNodeStatements) {
			continue
		}
		if value != nil {
			return nil, errors.New("two statements extensions")
		}
		if e.Critical {
			return nil, errors.New("the statements extension is critical")
		}
		value = e.Value
	}
	return value, nil
}

// CertStatements returns the urn:bc: statements of a node certificate in
// either form, without NodeIdentityOf's other checks; nil when it has none
// or they do not parse. Use it on a certificate already checked (bcd's own
// leaf).
func CertStatements(cert *x509.Certificate) []string {
	id, err := nodeStatements(cert)
	if err != nil {
		return nil
	}
	return id
}

// nodeStatements reads the statements of cert in the form it has: the
// extension (and then no URI SAN but the SPIFFE ID), or the URI SANs after
// the first.
func nodeStatements(cert *x509.Certificate) ([]string, error) {
	value, err := statementsExtension(cert)
	if err != nil {
		return nil, err
	}
	if value != nil {
		if len(cert.URIs) != 1 {
			return nil, errors.New("a statements extension beside further URI SANs")
		}
		return parseNodeStatements(value)
	}
	var statements []string
	for _, u := range cert.URIs[min(1, len(cert.URIs)):] {
		s := u.String()
		if !ValidStatement(s) {
			return nil, fmt.Errorf("URI SAN %q is not a urn:bc: statement", s)
		}
		statements = append(statements, s)
	}
	return statements, nil
}
