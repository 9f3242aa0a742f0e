package ca

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"net"
	"strings"
	"time"

	"github.com/better-compute/better-compute/internal/shared/dnsname"
	"github.com/better-compute/better-compute/internal/shared/pki"

	"github.com/better-compute/better-compute/internal/shared/errs"
)

// IssueGateway issues a gateway certificate from b's serving CA: a new ECDSA
// P-256 key, DNS and IP SANs from sans (at least one), valid from now (less
// a small backdate for clock skew) for ttl, with EKU serverAuth (bcd dials it)
// and clientAuth (the gateway's identity toward api). certPEM is the leaf
// then the serving CA; keyPEM is a plain PKCS#8 "PRIVATE KEY" block, which
// the caller writes 0600.
//
// Errors: errs.InvalidArgument for bad SANs or a ttl that is not positive or
// outlives the serving CA.
func IssueGateway(b *Bundle, sans []string, now time.Time, ttl time.Duration) (certPEM, keyPEM []byte, err error) {
	if len(sans) == 0 {
		return nil, nil, errs.Invalid("san", "at least one DNS name or IP address is required")
	}
	var dns []string
	var ips []net.IP
	for _, s := range sans {
		if ip := net.ParseIP(s); ip != nil {
			ips = append(ips, ip)
			continue
		}
		if !dnsname.Valid(strings.TrimPrefix(s, "*.")) {
			return nil, nil, errs.Invalid("san", "%q is neither a DNS name nor an IP address", s)
		}
		dns = append(dns, strings.ToLower(s))
	}
	notAfter := now.Add(ttl)
	if ttl <= 0 || notAfter.After(b.ServingCA.NotAfter) {
		return nil, nil, errs.Invalid("ttl", "must be positive and end before the serving CA expires (%s)", b.ServingCA.NotAfter.UTC().Format(time.RFC3339))
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, fmt.Errorf("generate gateway key: %w", err)
	}
	serial, err := randomSerial()
	if err != nil {
		return nil, nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber:          serial,
		Subject:               pkix.Name{CommonName: sans[0], Organization: []string{"better-compute"}, OrganizationalUnit: []string{"gateway"}},
		NotBefore:             now.Add(-backdate),
		NotAfter:              notAfter,
		KeyUsage:              x509.KeyUsageDigitalSignature,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
		BasicConstraintsValid: true,
		DNSNames:              dns,
		IPAddresses:           ips,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, b.ServingCA, key.Public(), b.ServingCAKey)
	if err != nil {
		return nil, nil, fmt.Errorf("sign gateway certificate: %w", err)
	}
	// Re-check what was issued.
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, nil, fmt.Errorf("parse gateway certificate: %w", err)
	}
	if err := cert.CheckSignatureFrom(b.ServingCA); err != nil || !publicKeyEqual(cert.PublicKey, key.Public()) {
		return nil, nil, fmt.Errorf("check gateway certificate: issued certificate does not match")
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return nil, nil, fmt.Errorf("marshal gateway key: %w", err)
	}
	certPEM = append(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), pki.CertPEM(b.ServingCA)...)
	keyPEM = pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER})
	return certPEM, keyPEM, nil
}
