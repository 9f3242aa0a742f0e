package api

import (
	"encoding/base64"
	"net/http"
	"time"

	"github.com/spiffe/go-spiffe/v2/bundle/spiffebundle"
	"github.com/spiffe/go-spiffe/v2/spiffeid"

	"github.com/better-compute/better-compute/internal/controlplane/ca"
	"github.com/better-compute/better-compute/internal/shared/wire"
)

// SPIFFEBundlePath is where, under the base path, the trust domain's SPIFFE
// bundle is served (R20.2): the SPIFFE federation https_web profile, a
// JWKS whose x509-svid keys are the node CAs that node certificates chain
// to, with spiffe_refresh_hint and spiffe_sequence. It needs no
// authentication: the node CAs are public, and a relying party
// authenticates this endpoint by its Web PKI (the API's TLS certificate).
const SPIFFEBundlePath = "/.well-known/spiffe-bundle"

// SPIFFERefreshHint is how often relying parties should fetch the bundle
// again. A node CA rotation publishes the next CA at prepare and keeps it
// accepted long before activation, so a few minutes is ample.
const SPIFFERefreshHint = 5 * time.Minute

// spiffeBundle is the SPIFFE bundle of b's trust domain: the node CAs it
// trusts now (a rotation's next or previous CA too).
func spiffeBundle(b *ca.Bundle) (*spiffebundle.Bundle, error) {
	td, err := spiffeid.TrustDomainFromString(b.TrustDomain)
	if err != nil {
		return nil, err
	}
	sb := spiffebundle.FromX509Authorities(td, b.TrustedNodeCAs())
	sb.SetRefreshHint(SPIFFERefreshHint)
	sb.SetSequenceNumber(b.BundleSequence())
	return sb, nil
}

// spiffeBundleHandler serves SPIFFEBundlePath from the live bundle, read
// once per request (Bundle.Now), so it follows the node CA's rotation.
func (s *Server) spiffeBundleHandler(w http.ResponseWriter, r *http.Request) {
	b := s.cfg.Bundle.Now()
	if b == nil {
		http.Error(w, "no machine PKI is configured (pki.dir)\n", http.StatusNotFound)
		return
	}
	sb, err := spiffeBundle(b)
	var doc []byte
	if err == nil {
		doc, err = sb.Marshal()
	}
	if err != nil {
		s.log.Error("spiffe bundle", "err", err)
		http.Error(w, "internal error\n", http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "max-age=60")
	_, _ = w.Write(doc)
}

// wellKnownSPIFFE is the well-known document's spiffe section.
func (s *Server) wellKnownSPIFFE(b *ca.Bundle) *wire.WellKnownSPIFFE {
	cas := b.TrustedNodeCAs()
	out := &wire.WellKnownSPIFFE{TrustDomain: b.TrustDomain, BundleEndpoint: s.cfg.BasePath + SPIFFEBundlePath,
		Sequence: b.BundleSequence(), NodeCAs: make([]string, len(cas))}
	for i, c := range cas {
		out.NodeCAs[i] = base64.StdEncoding.EncodeToString(c.Raw)
	}
	return out
}
