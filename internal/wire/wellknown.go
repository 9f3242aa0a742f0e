package wire

import "github.com/better-compute/better-compute/internal/pki"

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
