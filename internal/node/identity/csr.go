package identity

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"fmt"
	"unicode"

	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/pki"
)

// maxCommonNameHint is the X.520 upper bound on a common name.
const maxCommonNameHint = 64

// NewCSR returns a DER PKCS#10 request for signer's key, which must be ECDSA
// P-256 (R4.1). It carries no SANs: names come only from JoinService, never
// from the CSR (R7.2). commonNameHint (e.g. the hostname) only helps a
// person reading logs; empty means no subject at all. The request is
// checked the way JoinService will check it before it is returned.
func NewCSR(signer crypto.Signer, commonNameHint string) ([]byte, error) {
	pub, ok := signer.Public().(*ecdsa.PublicKey)
	if !ok || pub.Curve != elliptic.P256() {
		return nil, errs.New(errs.InvalidArgument, "the node key must be ECDSA P-256")
	}
	tmpl := &x509.CertificateRequest{SignatureAlgorithm: x509.ECDSAWithSHA256}
	if commonNameHint != "" {
		if len(commonNameHint) > maxCommonNameHint || !printable(commonNameHint) {
			return nil, errs.Invalid("commonNameHint", "want at most %d printable characters", maxCommonNameHint)
		}
		tmpl.Subject = pkix.Name{CommonName: commonNameHint}
	}
	der, err := x509.CreateCertificateRequest(rand.Reader, tmpl, signer)
	if err != nil {
		return nil, fmt.Errorf("create certificate request: %w", err)
	}
	got, err := pki.ParseCSR(der)
	if err != nil {
		return nil, fmt.Errorf("check certificate request: %w", err)
	}
	if !got.Equal(pub) {
		return nil, fmt.Errorf("check certificate request: the request carries another key")
	}
	return der, nil
}

func printable(s string) bool {
	for _, r := range s {
		if r == unicode.ReplacementChar || !unicode.IsPrint(r) {
			return false
		}
	}
	return true
}
