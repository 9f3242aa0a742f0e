package bcdconfig

import (
	"fmt"
	"net"
)

// DefaultDiagnosticsListen is the diagnostics address the docs and the Kubernetes manifests use.
const DefaultDiagnosticsListen = "127.0.0.1:9464"

// Diagnostics is the [diagnostics] section of bcd's config.toml: where bcd
// serves /livez, /readyz and /metrics (node/diag).
type Diagnostics struct {
	// Listen is host:port, e.g. "127.0.0.1:9464"; empty serves nothing.
	Listen string `toml:"listen,omitempty"`
	// AllowNonLoopback lets Listen be an address other machines reach
	// (readiness names the node's state; metrics its certificate's
	// lifetime). Off: only loopback addresses are accepted.
	AllowNonLoopback bool `toml:"allow_non_loopback,omitempty"`
}

// Problem is what is wrong with c.Listen ("" when nothing): it must be
// host:port on a loopback host unless AllowNonLoopback.
func (c Diagnostics) Problem() string {
	if c.Listen == "" {
		return ""
	}
	host, _, err := net.SplitHostPort(c.Listen)
	if err != nil {
		return fmt.Sprintf("%q: want host:port, e.g. %s", c.Listen, DefaultDiagnosticsListen)
	}
	if c.AllowNonLoopback || host == "localhost" {
		return ""
	}
	if ip := net.ParseIP(host); ip == nil || !ip.IsLoopback() {
		return fmt.Sprintf("%q is not a loopback address; use %s, or set diagnostics.allow_non_loopback = true", c.Listen, DefaultDiagnosticsListen)
	}
	return ""
}
