package enroll

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"slices"
	"time"

	"github.com/better-compute/better-compute/internal/shared/pki"
)

// PinnedTLSConfig returns the TLS configuration bcd dials its gateway with
// (R4.3): the gateway is authenticated by a serving CA whose SPKI hashes
// to a pin of servingCAPins (the pinned set, R16.2: during a rotation the
// old and the next CA), and by nothing else. The system roots play no part, so a
// public CA that misissues a certificate for the gateway's name is not
// trusted, and a gateway whose serving CA is private needs no root store.
//
// serverName is the name the gateway's certificate must carry (config
// gateway_server_name, else the gateway URL's host); it is also sent as SNI.
// now is the clock certificates are checked against.
//
// SECURITY: InsecureSkipVerify only turns off crypto/tls's own check
// against the system roots; VerifyConnection below replaces it and runs on
// every handshake, resumed sessions included (VerifyPeerCertificate would
// not run on resumption).
func PinnedTLSConfig(servingCAPins []string, serverName string, now func() time.Time) (*tls.Config, error) {
	if len(servingCAPins) == 0 {
		return nil, errors.New("pinned TLS: no serving_ca_spki_pin")
	}
	for _, p := range servingCAPins {
		if !pki.ValidPin(p) {
			return nil, errors.New("pinned TLS: serving_ca_spki_pin is not a pin")
		}
	}
	servingCAPins = slices.Clone(servingCAPins)
	if serverName == "" {
		return nil, errors.New("pinned TLS: no server name to verify")
	}
	if now == nil {
		now = time.Now
	}
	return &tls.Config{
		ServerName:         serverName,
		MinVersion:         tls.VersionTLS12,
		InsecureSkipVerify: true, // replaced by VerifyConnection, see above
		VerifyConnection: func(cs tls.ConnectionState) error {
			return VerifyPinnedChain(cs.PeerCertificates, servingCAPins, serverName, now())
		},
	}, nil
}

// VerifyPinnedChain accepts the certificates a gateway presented (leaf
// first) only when
//
//  1. one of the presented certificates after the leaf is a CA whose
//     SubjectPublicKeyInfo hashes to a pin of servingCAPins, and
//  2. the leaf verifies with crypto/x509 against that CA as the only root
//     (any other presented certificates may serve as intermediates), for
//     serverName, for server authentication, at now.
//
// The pin names a key, not a certificate, so the CA certificate itself
// comes from the peer: that is safe because the signature check in (2)
// proves the leaf was issued by the holder of the pinned key, whatever else
// the presented CA certificate says. A gateway that sends only its leaf
// cannot be verified and is refused with a message that says so.
func VerifyPinnedChain(presented []*x509.Certificate, servingCAPins []string, serverName string, now time.Time) error {
	if len(presented) == 0 {
		return &pinError{msg: "the gateway presented no certificate"}
	}
	leaf := presented[0]
	var pinnedCAs []*x509.Certificate
	for _, c := range presented[1:] {
		if c.BasicConstraintsValid && c.IsCA && pki.PinIn(servingCAPins, c.PublicKey) {
			pinnedCAs = append(pinnedCAs, c)
		}
	}
	if len(pinnedCAs) == 0 {
		if len(presented) == 1 {
			return &pinError{msg: "the gateway presented only its own certificate, without the serving CA that serving_ca_spki_pin names; configure the gateway with its full chain (leaf, then serving CA)"}
		}
		return &pinError{msg: "its certificate chain does not contain the serving CA that serving_ca_spki_pin names: this is not your gateway, or its certificate comes from another PKI"}
	}
	var lastErr error
	for _, ca := range pinnedCAs {
		roots := x509.NewCertPool()
		roots.AddCert(ca)
		intermediates := x509.NewCertPool()
		for _, c := range presented[1:] {
			if c != ca {
				intermediates.AddCert(c)
			}
		}
		_, err := leaf.Verify(x509.VerifyOptions{
			Roots:         roots,
			Intermediates: intermediates,
			DNSName:       serverName,
			CurrentTime:   now,
			KeyUsages:     []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		})
		if err == nil {
			return nil
		}
		lastErr = err
	}
	msg := "its certificate does not verify against the pinned serving CA: " + lastErr.Error()
	// R19.3: a certificate not valid yet or any more, by this machine's
	// clock, is what a clock far off looks like.
	var ie x509.CertificateInvalidError
	if errors.As(lastErr, &ie) && ie.Reason == x509.Expired {
		msg += " (if this machine's clock is off the control plane's, fix NTP)"
	}
	return &pinError{msg: msg, err: lastErr}
}

// pinError is VerifyPinnedChain's error, recognisable through the TLS,
// HTTP and Connect layers that wrap it, so the join can say the token was
// never sent.
type pinError struct {
	msg string
	err error
}

func (e *pinError) Error() string { return "pinned TLS: " + e.msg }
func (e *pinError) Unwrap() error { return e.err }

// PinFailure reports whether err (through the TLS, HTTP and Connect layers
// that wrap it) is a failed pinned verification of the gateway, and its
// message; a renewal says then that nothing was sent.
func PinFailure(err error) (string, bool) {
	var pe *pinError
	if errors.As(err, &pe) {
		return pe.msg, true
	}
	return "", false
}
