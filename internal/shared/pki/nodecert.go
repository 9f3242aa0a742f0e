package pki

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/sha256"
	"crypto/x509"
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

	MaxStatements   = 8
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

// SPIFFEID returns spiffe://<td>/site/<siteID>/node/<nodeID>. It does not
// validate; NodeSPIFFEID does.
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

// NodeSPIFFEID is a node's SPIFFE ID, checking each part.
func NodeSPIFFEID(td, siteID, nodeID string) (spiffeid.ID, error) {
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

// ValidStatement reports whether s is a well-formed urn:bc: statement a
// node certificate may carry.
func ValidStatement(s string) bool {
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
// spiffe://<td>/site/<site>/node/<node>; the urn:bc: statements either as
// every further URI SAN (SVIDFormPage) or in the OIDNodeStatements
// extension with no further URI SAN (SVIDFormStrict); no DNS, IP or email SANs; exactly one subject OU, bc-role:<role>
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
	statements, err := nodeStatements(cert)
	if err != nil {
		return bad("%w", err)
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
	if !IsP256(cert.PublicKey) {
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
