package wire

import (
	"encoding/base64"
	"net/http"
	"strings"

	"github.com/better-compute/better-compute/internal/shared/pki"
)

// DefaultBasePath is where the API is served.
const DefaultBasePath = "/api/compute"

// PeerAddrHeader carries the daemon's address from the gateway to the API.
const PeerAddrHeader = "Bc-Peer-Addr"

// WellKnown is the document at {basePath}/.well-known/better-compute (R11.6).
type WellKnown struct {
	Name     string             `json:"name"`
	Version  string             `json:"version"`
	BasePath string             `json:"basePath"`
	Protocol WellKnownProtocol  `json:"protocol"`
	Join     *pki.WellKnownJoin `json:"join,omitempty"`
	Gateway  *WellKnownGateway  `json:"gateway,omitempty"`
	// SPIFFE publishes the node CAs, for services that accept nodes' mTLS
	// (R20.2); present when the server has a machine PKI.
	SPIFFE *WellKnownSPIFFE `json:"spiffe,omitempty"`
}

// WellKnownSPIFFE is the trust domain's bundle: the node CAs a node
// certificate may chain to (more than one while the node CA rotates).
type WellKnownSPIFFE struct {
	TrustDomain string `json:"trustDomain"`
	// BundleEndpoint is the path of the SPIFFE bundle endpoint (https_web
	// profile) on this server, which relying parties poll.
	BundleEndpoint string `json:"bundleEndpoint"`
	// Sequence is the bundle's spiffe_sequence.
	Sequence uint64 `json:"sequence"`
	// NodeCAs are the node CA certificates, DER in standard base64.
	NodeCAs []string `json:"nodeCas"`
}

// WellKnownProtocol is the agent protocol range the server speaks.
type WellKnownProtocol struct {
	Min int `json:"min"`
	Max int `json:"max"`
}

// WellKnownGateway tells a daemon where its gateway is.
type WellKnownGateway struct {
	URL          string `json:"url"`
	ServerName   string `json:"serverName,omitempty"`
	ServingCAPin string `json:"servingCaPin,omitempty"`
}

// PeerCertificateHeader carries, from the gateway to the API's agent
// listener, the DER leaf a daemon presented on its TLS connection, in
// standard base64. The gateway drops any Bc-Peer-* header a daemon sent.
const PeerCertificateHeader = "Bc-Peer-Certificate"

// maxPeerCertificateB64 bounds the header; a node certificate is under 1 KiB.
const maxPeerCertificateB64 = 16 << 10

// SetPeerCertificate puts the daemon's certificate in the gateway's request.
func SetPeerCertificate(h http.Header, der []byte) {
	h.Set(PeerCertificateHeader, base64.StdEncoding.EncodeToString(der))
}

// PeerCertificate decodes the gateway's Bc-Peer-Certificate; nil when there
// is none, more than one, or it does not decode.
//
// SECURITY: the header is trusted only because the agent listener requires
// the gateway's client certificate and the gateway drops any Bc-Peer-*
// header a daemon sent; callers still match the DER byte for byte against
// node_certs, so a gateway can only name a certificate that was issued.
func PeerCertificate(h http.Header) []byte {
	vals := h.Values(PeerCertificateHeader)
	if len(vals) != 1 || len(vals[0]) > maxPeerCertificateB64 {
		return nil
	}
	der, err := base64.StdEncoding.DecodeString(vals[0])
	if err != nil {
		return nil
	}
	return der
}

// KindAllowed reports whether a command kind is in allowed (exact kinds or
// prefix.*); an empty list allows every kind (R7.5). The API checks it at
// enqueue and delivery, the gateway again at dispatch.
func KindAllowed(allowed []string, kind string) bool {
	if len(allowed) == 0 {
		return true
	}
	for _, a := range allowed {
		if a == kind {
			return true
		}
		if p, ok := strings.CutSuffix(a, ".*"); ok && strings.HasPrefix(kind, p+".") {
			return true
		}
	}
	return false
}
