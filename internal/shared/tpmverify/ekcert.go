package tpmverify

import (
	"crypto"
	"crypto/subtle"
	"crypto/x509"
	"encoding/asn1"
	"encoding/pem"
	"fmt"
	"os"
	"slices"
	"time"

	"github.com/google/go-tpm/tpm2"
)

// oidSAN is the subjectAltName extension.
var oidSAN = asn1.ObjectIdentifier{2, 5, 29, 17}

// ParseEKCertificate parses an EK certificate. TCG EK certificates mark
// their subjectAltName critical and put only a directoryName in it (the TPM
// manufacturer, model and version), which Go's parser leaves unhandled, so
// x509.Certificate.Verify would refuse it: ParseEKCertificate checks that
// the SAN holds only directoryNames and marks it handled.
func ParseEKCertificate(der []byte) (*x509.Certificate, error) {
	c, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, fail(ReasonEKCertInvalid, "parse: %v", err)
	}
	var kept []asn1.ObjectIdentifier
	for _, oid := range c.UnhandledCriticalExtensions {
		if oid.Equal(oidSAN) {
			if err := dirNamesOnly(c); err != nil {
				return nil, err
			}
			continue
		}
		kept = append(kept, oid)
	}
	c.UnhandledCriticalExtensions = kept
	return c, nil
}

// dirNamesOnly checks that c's SAN holds directoryNames ([4]) only.
func dirNamesOnly(c *x509.Certificate) error {
	for _, e := range c.Extensions {
		if !e.Id.Equal(oidSAN) {
			continue
		}
		var names []asn1.RawValue
		if rest, err := asn1.Unmarshal(e.Value, &names); err != nil || len(rest) != 0 {
			return fail(ReasonEKCertInvalid, "the subjectAltName does not parse")
		}
		for _, n := range names {
			if n.Class != asn1.ClassContextSpecific || n.Tag != 4 {
				return fail(ReasonEKCertInvalid, "the subjectAltName holds a name of tag %d, want directoryName", n.Tag)
			}
		}
	}
	return nil
}

// Trust decides whether an EK is trusted (R9.2): its certificate chains to
// one of the manufacturer CAs, or its hash (EKHash) is on the allow-list.
type Trust struct {
	// CAs are the manufacturer CAs (any listed certificate anchors a
	// chain).
	CAs *x509.CertPool
	// EKHashes are allowed EK hashes (EKHash).
	EKHashes [][]byte
}

// LoadCAs reads manufacturer CA certificates from PEM files.
func LoadCAs(paths []string) (*x509.CertPool, error) {
	pool := x509.NewCertPool()
	for _, p := range paths {
		b, err := os.ReadFile(p)
		if err != nil {
			return nil, fmt.Errorf("read the TPM manufacturer CA %s: %w", p, err)
		}
		n := 0
		for {
			var block *pem.Block
			block, b = pem.Decode(b)
			if block == nil {
				break
			}
			if block.Type != "CERTIFICATE" {
				continue
			}
			c, err := ParseEKCertificate(block.Bytes)
			if err != nil {
				return nil, fmt.Errorf("the TPM manufacturer CA %s: %w", p, err)
			}
			pool.AddCert(c)
			n++
		}
		if n == 0 {
			return nil, fmt.Errorf("the TPM manufacturer CA %s holds no PEM certificate", p)
		}
	}
	return pool, nil
}

// Trusted reports whether the EK is trusted: by hash, or by a certificate
// (DER, may be nil) for this very key that chains to a manufacturer CA at
// now. A certificate that is present but fails is an error with its
// reason; an EK that is simply unknown is (false, nil).
func (t *Trust) Trusted(ek *tpm2.TPMTPublic, certDER []byte, now time.Time) (bool, error) {
	h, err := EKHash(ek)
	if err != nil {
		return false, fail(ReasonEKInvalid, "EK public key: %v", err)
	}
	if slices.ContainsFunc(t.EKHashes, func(a []byte) bool { return subtle.ConstantTimeCompare(a, h) == 1 }) {
		return true, nil
	}
	if len(certDER) == 0 || t.CAs == nil {
		return false, nil
	}
	c, err := ParseEKCertificate(certDER)
	if err != nil {
		return false, err
	}
	pub, _ := tpm2.Pub(*ek)
	if eq, ok := c.PublicKey.(interface{ Equal(crypto.PublicKey) bool }); !ok || !eq.Equal(pub) {
		return false, fail(ReasonEKCertKey, "the EK certificate is for another key")
	}
	// Go does not know the EK certificate's EKU (2.23.133.8.1).
	if _, err := c.Verify(x509.VerifyOptions{Roots: t.CAs, CurrentTime: now, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageAny}}); err != nil {
		return false, nil
	}
	return true, nil
}
