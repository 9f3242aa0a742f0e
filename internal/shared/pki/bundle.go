package pki

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"strings"

	"github.com/spiffe/go-spiffe/v2/spiffeid"

	"github.com/better-compute/better-compute/internal/shared/errs"
)

// Pins are the SPKI pins a bcd config carries (see Pin).
type Pins struct {
	ServingCA      string
	JoinSigning    string
	JoinEncryption string
}

// ValidateTrustDomain checks that td is a bare SPIFFE trust domain name
// (lower case letters, digits, '.', '-', '_'; not a spiffe:// URI). The error
// is errs.InvalidArgument on field "trustDomain".
func ValidateTrustDomain(td string) error {
	parsed, err := spiffeid.TrustDomainFromString(td)
	if err != nil || parsed.Name() != td || len(td) > 255 ||
		strings.HasPrefix(td, ".") || strings.HasSuffix(td, ".") || strings.Contains(td, "..") {
		return errs.Invalid("trustDomain", "%q is not a trust domain name (lower case letters, digits, '.', '-' and '_', like compute.example.com)", td)
	}
	return nil
}

// IsP256 reports whether pub is an ECDSA P-256 public key.
func IsP256(pub crypto.PublicKey) bool {
	k, ok := pub.(*ecdsa.PublicKey)
	return ok && k.Curve == elliptic.P256()
}

// ChainPEM is a chain of DER certificates as PEM "CERTIFICATE" blocks, in
// order.
func ChainPEM(ders [][]byte) []byte {
	var out []byte
	for _, d := range ders {
		out = append(out, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: d})...)
	}
	return out
}

// CertPEM returns cert as a PEM "CERTIFICATE" block.
func CertPEM(cert *x509.Certificate) []byte {
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: cert.Raw})
}

// WellKnownJoin is the join section of the well-known document (R11.6).
type WellKnownJoin struct {
	EncryptionJWK      json.RawMessage `json:"encryptionJwk"`
	EncryptionKeyPin   string          `json:"encryptionKeyPin"`
	SigningCertificate string          `json:"signingCertificate"`
	SigningKeyPin      string          `json:"signingKeyPin"`
	// KeyStatements are the rotation statements (R16.2, KeyStatement); a
	// daemon applies only those a key it pins signed.
	KeyStatements []string `json:"keyStatements,omitempty"`
}
