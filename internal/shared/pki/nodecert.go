package pki

import (
	"bytes"
	"crypto"
	"crypto/ecdsa"
	"crypto/sha256"
	"crypto/x509"
	"errors"
	"fmt"
	"net/url"
	"slices"
	"strings"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"

	"github.com/better-compute/better-compute/internal/shared/errs"
)

// Node roles, the OU=bc-role:<role> of a node certificate (R7.3).
const (
	RoleNode       = "node"
	RoleSite       = "site"
	RoleRamdisk    = "ramdisk"
	RoleNodeTenant = "node-tenant"
)

const (
	// RoleOUPrefix starts the subject OU that carries the role.
	RoleOUPrefix = "bc-role:"
	// StatementPrefix starts every URI SAN after the SPIFFE ID: a statement
	// about the node key (today urn:bc:tpm-ak:<nameAlg>:<digest>), never an
	// identity.
	StatementPrefix = "urn:bc:"
	// MaxNodeCertLifetime is the hard ceiling on a node certificate's
	// NotAfter-NotBefore (R7.1); JoinService's certTtlSeconds may only be
	// shorter. A backdated NotBefore counts against it.
	MaxNodeCertLifetime = 24 * time.Hour
	// MaxRamdiskCertLifetime is the ceiling for role ramdisk.
	MaxRamdiskCertLifetime = 2 * time.Hour

	maxStatements   = 8
	maxStatementLen = 512
	maxCSRSize      = 16 << 10
)

// ValidRole reports whether role is one a node certificate may carry.
func ValidRole(role string) bool {
	switch role {
	case RoleNode, RoleSite, RoleRamdisk, RoleNodeTenant:
		return true
	}
	return false
}

// NodeCertParams is the policy JoinService decides for a node certificate.
// Names and statements come only from here, never from the CSR (R7.2).
type NodeCertParams struct {
	TrustDomain string
	SiteID      string
	NodeID      string
	Role        string
	// Statements are extra URI SANs after the SPIFFE ID; each starts with
	// "urn:bc:".
	Statements []string
	// NotBefore and NotAfter are used as given (at second precision).
	NotBefore, NotAfter time.Time
}

// NodeIdentity is what a node certificate says (see ParseNodeCert).
type NodeIdentity struct {
	TrustDomain string
	SiteID      string
	NodeID      string
	Role        string
	Statements  []string
}

// SPIFFEID returns the identity's SPIFFE ID.
func (id NodeIdentity) SPIFFEID() string { return SPIFFEID(id.TrustDomain, id.SiteID, id.NodeID) }

// NodeCert is an issued node certificate with what a node_certs row records.
type NodeCert struct {
	DER  []byte
	Cert *x509.Certificate
	// Serial is the serial number in lower-case hex (SerialHex).
	Serial string
	// SPKISHA256 is the SHA-256 of the certificate's SubjectPublicKeyInfo.
	SPKISHA256 []byte
}

// SPIFFEID returns spiffe://<td>/site/<siteID>/node/<nodeID>. It does not
// validate; nodeSPIFFEID does.
func SPIFFEID(td, siteID, nodeID string) string {
	return "spiffe://" + td + "/site/" + siteID + "/node/" + nodeID
}

// SerialHex returns cert's serial number as lower-case hex, the form stored
// and compared everywhere.
func SerialHex(cert *x509.Certificate) string { return cert.SerialNumber.Text(16) }

// SPKIHash returns the SHA-256 of cert's SubjectPublicKeyInfo.
func SPKIHash(cert *x509.Certificate) []byte {
	sum := sha256.Sum256(cert.RawSubjectPublicKeyInfo)
	return sum[:]
}

// PublicKeySPKIHash returns the SHA-256 of pub's SubjectPublicKeyInfo: the
// SPKIHash a certificate for pub will have.
func PublicKeySPKIHash(pub crypto.PublicKey) ([]byte, error) {
	der, err := x509.MarshalPKIXPublicKey(pub)
	if err != nil {
		return nil, fmt.Errorf("marshal public key: %w", err)
	}
	sum := sha256.Sum256(der)
	return sum[:], nil
}

func nodeSPIFFEID(td, siteID, nodeID string) (spiffeid.ID, error) {
	if err := ValidateTrustDomain(td); err != nil {
		return spiffeid.ID{}, err
	}
	t, _ := spiffeid.TrustDomainFromString(td)
	id, err := spiffeid.FromSegments(t, "site", siteID, "node", nodeID)
	if err != nil {
		return spiffeid.ID{}, errs.Invalid("nodeId", "site %q and node %q do not make a SPIFFE ID", siteID, nodeID)
	}
	return id, nil
}

func validStatement(s string) bool {
	if !strings.HasPrefix(s, StatementPrefix) || len(s) == len(StatementPrefix) || len(s) > maxStatementLen {
		return false
	}
	for i := 0; i < len(s); i++ {
		if s[i] <= ' ' || s[i] >= 0x7f {
			return false
		}
	}
	u, err := url.Parse(s)
	// The URI must survive the round trip through the certificate unchanged.
	return err == nil && u.String() == s
}

// ParseCSR parses a PKCS#10 request, checks its signature and that its key
// is ECDSA P-256, and returns the public key. Nothing else of the CSR is
// used. Errors are errs.InvalidArgument on field "csr".
func ParseCSR(csrDER []byte) (*ecdsa.PublicKey, error) {
	if len(csrDER) == 0 || len(csrDER) > maxCSRSize {
		return nil, errs.Invalid("csr", "size outside 1..%d bytes", maxCSRSize)
	}
	return parseCSR(csrDER)
}

// SignNodeCert issues a node client certificate from the node CA (ca,
// caKey) for the key in csrDER, in the order the design fixes: check the CSR
// (signature, ECDSA P-256), take only its public key, build the template from
// p, sign, then re-parse the result with crypto/x509 and check that its names,
// role, key and validity are what p asked for.
//
// The certificate has exactly one SPIFFE URI SAN,
// spiffe://<td>/site/<site>/node/<node>, first, then p.Statements; subject
// CN=<node>, OU=bc-role:<role>; EKU clientAuth; a random 128-bit serial.
//
// Errors: errs.InvalidArgument for a bad CSR or bad params.
func SignNodeCert(ca *x509.Certificate, caKey crypto.Signer, csrDER []byte, p NodeCertParams) (*NodeCert, error) {
	// 1. Check the CSR; keep only its key.
	pub, err := ParseCSR(csrDER)
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
	if pub == nil || !isP256(pub) {
		return nil, errs.Invalid("csr", "the key must be ECDSA P-256")
	}
	// 2. The template comes from policy only.
	id, err := nodeSPIFFEID(p.TrustDomain, p.SiteID, p.NodeID)
	if err != nil {
		return nil, err
	}
	if !ValidRole(p.Role) {
		return nil, errs.Invalid("role", "%q is not one of node, site, ramdisk, node-tenant", p.Role)
	}
	if len(p.Statements) > maxStatements {
		return nil, errs.Invalid("statements", "at most %d", maxStatements)
	}
	uris := []string{id.String()}
	for i, s := range p.Statements {
		if !validStatement(s) || slices.Contains(p.Statements[:i], s) {
			return nil, errs.Invalid("statements", "%q is not a distinct urn:bc: URI", s)
		}
		uris = append(uris, s)
	}
	notBefore := p.NotBefore.UTC().Truncate(time.Second)
	notAfter := p.NotAfter.UTC().Truncate(time.Second)
	lifetime := notAfter.Sub(notBefore)
	maxLifetime := MaxNodeCertLifetime
	if p.Role == RoleRamdisk {
		maxLifetime = MaxRamdiskCertLifetime
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
	// 3. Sign: the TBS is assembled here (node certificates have one fixed
	// shape, the same bytes x509.CreateCertificate would produce for it),
	// signed with caKey, and the signature verified once.
	der, err := signNodeTBS(ca, caKey, pub, serial, p, notBefore, notAfter, uris)
	if err != nil {
		return nil, fmt.Errorf("sign node certificate: %w", err)
	}
	// 4. Re-check what was issued, as a verifier will read it.
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, fmt.Errorf("parse issued certificate: %w", err)
	}
	got, err := NodeIdentityOf(cert)
	if err != nil {
		return nil, fmt.Errorf("check issued certificate: %w", err)
	}
	want := NodeIdentity{TrustDomain: p.TrustDomain, SiteID: p.SiteID, NodeID: p.NodeID, Role: p.Role, Statements: p.Statements}
	if got.TrustDomain != want.TrustDomain || got.SiteID != want.SiteID || got.NodeID != want.NodeID ||
		got.Role != want.Role || !slices.Equal(got.Statements, want.Statements) ||
		!pub.Equal(cert.PublicKey) || !cert.NotBefore.Equal(notBefore) || !cert.NotAfter.Equal(notAfter) ||
		cert.SerialNumber.Cmp(serial) != 0 || !bytes.Equal(cert.RawIssuer, ca.RawSubject) {
		return nil, errors.New("check issued certificate: it differs from the template")
	}
	return &NodeCert{DER: der, Cert: cert, Serial: SerialHex(cert), SPKISHA256: SPKIHash(cert)}, nil
}

// ParseNodeCert parses a node certificate and returns its identity; see
// NodeIdentityOf for the checks. It does not verify the chain or validity
// period: TLS (with the node CA as the only root) or the caller does that.
func ParseNodeCert(der []byte) (NodeIdentity, error) {
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return NodeIdentity{}, fmt.Errorf("parse node certificate: %w", err)
	}
	return NodeIdentityOf(cert)
}

// NodeIdentityOf checks that cert has the shape of a node certificate and
// returns its identity: exactly one SPIFFE URI SAN, first, of the form
// spiffe://<td>/site/<site>/node/<node>; every further URI SAN a urn:bc:
// statement; no DNS, IP or email SANs; exactly one subject OU, bc-role:<role>
// with a known role; not a CA; EKU clientAuth; an ECDSA P-256 key. bcd (on
// its join response) and the gateway (on a session) use it.
func NodeIdentityOf(cert *x509.Certificate) (NodeIdentity, error) {
	bad := func(format string, args ...any) (NodeIdentity, error) {
		return NodeIdentity{}, fmt.Errorf("check node certificate: "+format, args...)
	}
	if len(cert.URIs) == 0 {
		return bad("no URI SAN")
	}
	id, err := spiffeid.FromURI(cert.URIs[0])
	if err != nil {
		return bad("the first URI SAN is not a SPIFFE ID: %w", err)
	}
	segs := strings.Split(strings.TrimPrefix(id.Path(), "/"), "/")
	if len(segs) != 4 || segs[0] != "site" || segs[2] != "node" {
		return bad("SPIFFE ID %s is not a node ID", id)
	}
	var statements []string
	for _, u := range cert.URIs[1:] {
		s := u.String()
		if !validStatement(s) {
			return bad("URI SAN %q is not a urn:bc: statement", s)
		}
		statements = append(statements, s)
	}
	if len(cert.DNSNames)+len(cert.IPAddresses)+len(cert.EmailAddresses) != 0 {
		return bad("unexpected DNS, IP or email SAN")
	}
	if len(cert.Subject.OrganizationalUnit) != 1 {
		return bad("want exactly one subject OU")
	}
	role, ok := strings.CutPrefix(cert.Subject.OrganizationalUnit[0], RoleOUPrefix)
	if !ok || !ValidRole(role) {
		return bad("OU %q is not a role", cert.Subject.OrganizationalUnit[0])
	}
	if cert.IsCA || cert.KeyUsage&(x509.KeyUsageCertSign|x509.KeyUsageCRLSign) != 0 {
		return bad("a CA certificate")
	}
	if !slices.Contains(cert.ExtKeyUsage, x509.ExtKeyUsageClientAuth) {
		return bad("no clientAuth EKU")
	}
	if !isP256(cert.PublicKey) {
		return bad("the key is not ECDSA P-256")
	}
	return NodeIdentity{
		TrustDomain: id.TrustDomain().Name(),
		SiteID:      segs[1],
		NodeID:      segs[3],
		Role:        role,
		Statements:  statements,
	}, nil
}
