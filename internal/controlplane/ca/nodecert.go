package ca

import (
	"bytes"
	"crypto"
	"crypto/ecdsa"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"fmt"
	"net/url"
	"slices"
	"time"

	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/pki"
)

// NodeCertParams is the policy JoinService decides for a node certificate.
// Names and statements come only from here, never from the CSR (R7.2).
type NodeCertParams struct {
	TrustDomain string
	SiteID      string
	NodeID      string
	Role        string
	// Statements are the urn:bc: statements about the node key: extra URI
	// SANs after the SPIFFE ID, or, with StatementsInExtension, the value
	// of the pki.OIDNodeStatements extension.
	Statements []string
	// StatementsInExtension issues the SPIFFE-strict form
	// (pki.SVIDFormStrict, R20.1): the SPIFFE ID is the only URI SAN.
	StatementsInExtension bool
	// NotBefore and NotAfter are used as given (at second precision).
	NotBefore, NotAfter time.Time
}

// NodeCert is an issued node certificate with what a node_certs row records.
type NodeCert struct {
	DER  []byte
	Cert *x509.Certificate
	// Serial is the serial number in lower-case hex (SerialHex).
	Serial string
	// SPKISHA256 is the SHA-256 of the certificate's SubjectPublicKeyInfo.
	SPKISHA256 []byte
}

// SignNodeCert issues a node client certificate from the node CA (ca,
// caKey) for the key in csrDER, always in this order: check the CSR
// (signature, ECDSA P-256), take only its public key, build the template from
// p, sign, then re-parse the result with crypto/x509 and check that its names,
// role, key and validity are what p asked for.
//
// The certificate has exactly one SPIFFE URI SAN,
// spiffe://<td>/site/<site>/node/<node>, first, then p.Statements; subject
// CN=<node>, OU=bc-role:<role>; EKU serverAuth and clientAuth (X.509-SVID
// 4.4: an SVID may serve TLS too, R20.1); a random 128-bit serial. With
// p.StatementsInExtension the statements go into the pki.OIDNodeStatements
// extension instead, and the SPIFFE ID is the only URI SAN.
//
// Errors: errs.InvalidArgument for a bad CSR or bad params.
func SignNodeCert(ca *x509.Certificate, caKey crypto.Signer, csrDER []byte, p NodeCertParams) (*NodeCert, error) {
	// 1. Check the CSR; keep only its key.
	pub, err := pki.ParseCSR(csrDER)
	if err != nil {
		return nil, err
	}
	return SignNodeCertKey(ca, caKey, pub, p)
}

// SignNodeCertKey is SignNodeCert for a key the caller already took from a
// CSR that ParseCSR checked: JoinService checks the CSR before any database
// work and signs later, and verifying the CSR's signature twice costs as much
// as signing. pub must come from ParseCSR; only its curve is checked again.
func SignNodeCertKey(ca *x509.Certificate, caKey crypto.Signer, pub *ecdsa.PublicKey, p NodeCertParams) (*NodeCert, error) {
	if pub == nil || !pki.IsP256(pub) {
		return nil, errs.Invalid("csr", "the key must be ECDSA P-256")
	}
	// 2. The template comes from policy only.
	id, err := pki.NodeSPIFFEID(p.TrustDomain, p.SiteID, p.NodeID)
	if err != nil {
		return nil, err
	}
	if !pki.ValidRole(p.Role) {
		return nil, errs.Invalid("role", "%q is not one of node, site, ramdisk, node-tenant", p.Role)
	}
	if len(p.Statements) > pki.MaxStatements {
		return nil, errs.Invalid("statements", "at most %d", pki.MaxStatements)
	}
	uris := []string{id.String()}
	for i, s := range p.Statements {
		if !pki.ValidStatement(s) || slices.Contains(p.Statements[:i], s) {
			return nil, errs.Invalid("statements", "%q is not a distinct urn:bc: URI", s)
		}
	}
	var stmtExt []byte
	if p.StatementsInExtension && len(p.Statements) > 0 {
		if stmtExt, err = pki.MarshalNodeStatements(p.Statements); err != nil {
			return nil, errs.Invalid("statements", "%v", err)
		}
	} else {
		uris = append(uris, p.Statements...)
	}
	notBefore := p.NotBefore.UTC().Truncate(time.Second)
	notAfter := p.NotAfter.UTC().Truncate(time.Second)
	lifetime := notAfter.Sub(notBefore)
	maxLifetime := pki.MaxNodeCertLifetime
	if p.Role == pki.RoleRamdisk {
		maxLifetime = pki.MaxRamdiskCertLifetime
	}
	if p.NotBefore.IsZero() || lifetime <= 0 || lifetime > maxLifetime {
		return nil, errs.Invalid("notAfter", "the lifetime must be positive and at most %s for role %s", maxLifetime, p.Role)
	}
	if notAfter.After(ca.NotAfter) || notBefore.Before(ca.NotBefore) {
		return nil, errs.Invalid("notAfter", "the certificate must lie within the node CA's validity")
	}
	serial, err := randomSerial()
	if err != nil {
		return nil, err
	}
	// 3. Sign. x509.CreateCertificate checks that caKey is ca's key and
	// verifies the signature it made before returning.
	tmpl := &x509.Certificate{
		SerialNumber:          serial,
		Subject:               pkix.Name{CommonName: p.NodeID, OrganizationalUnit: []string{pki.RoleOUPrefix + p.Role}},
		NotBefore:             notBefore,
		NotAfter:              notAfter,
		KeyUsage:              x509.KeyUsageDigitalSignature,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
		BasicConstraintsValid: true,
	}
	for _, u := range uris {
		parsed, err := url.Parse(u)
		if err != nil || parsed.String() != u {
			return nil, errs.Invalid("statements", "%q is not a URI in its one written form", u)
		}
		tmpl.URIs = append(tmpl.URIs, parsed)
	}
	if stmtExt != nil {
		tmpl.ExtraExtensions = []pkix.Extension{{Id: pki.OIDNodeStatements, Value: stmtExt}}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, pub, caKey)
	if err != nil {
		return nil, fmt.Errorf("sign node certificate: %w", err)
	}
	// 4. Re-check what was issued, as a verifier will read it.
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, fmt.Errorf("parse issued certificate: %w", err)
	}
	got, err := pki.NodeIdentityOf(cert)
	if err != nil {
		return nil, fmt.Errorf("check issued certificate: %w", err)
	}
	want := pki.NodeIdentity{TrustDomain: p.TrustDomain, SiteID: p.SiteID, NodeID: p.NodeID, Role: p.Role, Statements: p.Statements}
	if got.TrustDomain != want.TrustDomain || got.SiteID != want.SiteID || got.NodeID != want.NodeID ||
		got.Role != want.Role || !slices.Equal(got.Statements, want.Statements) ||
		len(cert.URIs) != len(uris) || !pub.Equal(cert.PublicKey) || !cert.NotBefore.Equal(notBefore) || !cert.NotAfter.Equal(notAfter) ||
		cert.SerialNumber.Cmp(serial) != 0 || !bytes.Equal(cert.RawIssuer, ca.RawSubject) {
		return nil, errors.New("check issued certificate: it differs from the template")
	}
	return &NodeCert{DER: der, Cert: cert, Serial: pki.SerialHex(cert), SPKISHA256: pki.SPKIHash(cert)}, nil
}
