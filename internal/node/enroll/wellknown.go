package enroll

import (
	"context"
	"crypto/ecdsa"
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/better-compute/better-compute/internal/shared/bcdconfig"
	"github.com/better-compute/better-compute/internal/shared/wire"

	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/pki"
)

const (
	// DefaultBasePath is the control plane's base path when --server names
	// only a host.
	DefaultBasePath = "/api/compute"
	// wellKnownSuffix follows the base path.
	wellKnownSuffix = "/.well-known/better-compute"
	// maxWellKnownSize bounds the document; a real one is about 1 KiB.
	maxWellKnownSize = 64 << 10
	// wellKnownTimeout bounds the whole fetch.
	wellKnownTimeout = 15 * time.Second
)

// WellKnownURL returns the URL of the well-known document for a --server
// value: <server><basePath>/.well-known/better-compute, where basePath is
// the server URL's own path when it has one, else /api/compute. http is
// accepted as well as https, since nothing in the document is trusted
// without a pin (R11.1).
func WellKnownURL(server string) (string, error) {
	u, err := url.Parse(server)
	if err != nil {
		return "", errs.Invalid("--server", "not a URL")
	}
	switch {
	case u.Scheme != "https" && u.Scheme != "http":
		return "", errs.Invalid("--server", "want the control plane's URL, like https://compute.example.com")
	case u.Host == "":
		return "", errs.Invalid("--server", "want a host, like https://compute.example.com")
	case u.User != nil:
		return "", errs.Invalid("--server", "must not carry credentials")
	case u.RawQuery != "" || u.Fragment != "" || u.ForceQuery:
		return "", errs.Invalid("--server", "must not carry a query or fragment")
	}
	base := strings.TrimSuffix(u.EscapedPath(), "/")
	if base == "" {
		base = DefaultBasePath
	}
	return u.Scheme + "://" + u.Host + base + wellKnownSuffix, nil
}

// wellKnown is the part of the well-known document bcd reads, already
// checked against the pins it was asked to check.
type wellKnown struct {
	url string
	doc wire.WellKnown
	// encKey is join.encryptionJwk, when it matched the encryption pin.
	encKey *ecdsa.PublicKey
	// signingCert is join.signingCertificate, when its key matched the
	// signing pin.
	signingCert *x509.Certificate
	// pins are the pin sets the document was checked against: the caller's,
	// after the document's key statements (R16.2) that a pinned key signed.
	pins *bcdconfig.Config
	// learned says whether the statements changed a set.
	learned bcdconfig.PinUpdate
}

// source is where the well-known document comes from: the control plane's
// URL and the CAs that verify it (nil: the system roots).
type source struct {
	url string
	cas *x509.CertPool
}

func (o Options) wellKnownSource() source { return source{url: o.Server, cas: o.ServerCAs} }

// fetchWellKnown GETs the document with a bounded body and timeout and
// parses the join section against the pin sets of pins. It trusts nothing in
// the document: its key statements count only when signed by a key pins
// already pins (applied to a copy, wellKnown.pins; the caller persists
// them), and the encryption key and the signing certificate are kept only
// when they match a pin of their (updated) set. An encryption key that does
// not match is an error (there is nothing else to seal to); a signing
// certificate that does not match is dropped (the response carries its
// own).
func (j *Joiner) fetchWellKnown(ctx context.Context, server source, pins *bcdconfig.Config) (*wellKnown, error) {
	u, err := WellKnownURL(server.url)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(ctx, wellKnownTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return nil, errs.Invalid("--server", "cannot make a request: %v", err)
	}
	req.Header.Set("Accept", "application/json")
	// SECURITY: without --server-ca-file the TLS chain is not verified:
	// the document is trusted only through the pins below (its encryption
	// key must match a pinned one, its statements count only when a pinned
	// key signed them, and the gateway it names is verified against the
	// serving CA pin), so a control plane whose certificate comes from a
	// private CA needs no CA file. Given one, the chain must verify
	// against it, as asked.
	tlsConfig := &tls.Config{InsecureSkipVerify: true, MinVersion: tls.VersionTLS12} //nolint:gosec // pin-checked document, see above
	if server.cas != nil {
		tlsConfig = &tls.Config{RootCAs: server.cas, MinVersion: tls.VersionTLS12}
	}
	res, err := j.httpClient(tlsConfig).Do(req)
	if err != nil {
		var unknown x509.UnknownAuthorityError
		if errors.As(err, &unknown) {
			return nil, errs.Wrap(err, errs.Unavailable, "cannot fetch %s: %v: the certificate does not come from the CAs of --server-ca-file (leave the flag out to trust the document through the pins alone)", u, err)
		}
		return nil, errs.Wrap(err, errs.Unavailable, "cannot fetch %s: %v", u, err)
	}
	defer res.Body.Close()
	if res.StatusCode != http.StatusOK {
		return nil, errs.New(errs.Unavailable, "%s answered %s: is --server the control plane's URL (with its base path, if not %s)?", u, res.Status, DefaultBasePath)
	}
	data, err := io.ReadAll(io.LimitReader(res.Body, maxWellKnownSize+1))
	if err != nil {
		return nil, errs.Wrap(err, errs.Unavailable, "cannot read %s: %v", u, err)
	}
	if len(data) > maxWellKnownSize {
		return nil, errs.New(errs.InvalidConfig, "%s is larger than %d bytes: not a better-compute well-known document", u, maxWellKnownSize)
	}
	wk := &wellKnown{url: u}
	if err := json.Unmarshal(data, &wk.doc); err != nil || wk.doc.Name != "better-compute" {
		return nil, errs.New(errs.InvalidConfig, "%s is not a better-compute well-known document", u)
	}
	if wk.doc.Join == nil {
		return nil, errs.New(errs.InvalidConfig, "%s has no join section: the control plane's JoinService is not configured (pki.join)", u)
	}
	checked := *pins
	wk.pins = &checked
	// SECURITY (R16.2): only statements signed by a pinned key count.
	wk.learned = wk.pins.ApplyStatements(wk.doc.Join.KeyStatements)
	pub, err := pki.ParseEncryptionJWK(wk.doc.Join.EncryptionJWK)
	if err != nil {
		return nil, errs.New(errs.InvalidConfig, "%s: join.encryptionJwk is not a P-256 public JWK", u)
	}
	// SECURITY: the pin is what makes an unauthenticated fetch safe.
	if !pki.PinIn(wk.pins.JoinEncryptionPins(), pub) {
		return nil, errs.New(errs.InvalidConfig,
			"the JoinService encryption key at %s does not match join_encryption_key_pin: the key was rotated (generate the install script again for the new pins) or this is not your control plane", u)
	}
	wk.encKey = pub
	if der, err := base64.StdEncoding.DecodeString(wk.doc.Join.SigningCertificate); err == nil {
		if cert, err := x509.ParseCertificate(der); err == nil && pki.PinIn(wk.pins.JoinSigningPins(), cert.PublicKey) {
			wk.signingCert = cert
		}
	}
	return wk, nil
}
