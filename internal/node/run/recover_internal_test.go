package run

import (
	"crypto/x509"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/node/identity"
	"github.com/better-compute/better-compute/internal/node/nodesession"
)

// R19.3: no session opens on a certificate that expires before the next
// heartbeat, but the margin never exceeds a quarter of the certificate's
// life (a 60 s certificate under a 60 s heartbeat still connects).
func TestExpiryMargin(t *testing.T) {
	now := time.Unix(1_800_000_000, 0)
	for _, c := range []struct {
		name string
		beat time.Duration // the last Welcome's; 0: none yet
		life time.Duration
		want time.Duration
	}{
		{"before any Welcome", 0, 24 * time.Hour, nodesession.DefaultHeartbeat},
		{"the Welcome's heartbeat", 20 * time.Second, 24 * time.Hour, 20 * time.Second},
		{"a short certificate", 60 * time.Second, 60 * time.Second, 15 * time.Second},
	} {
		d := &Daemon{beat: c.beat}
		id := &identity.Identity{Chain: []*x509.Certificate{{NotBefore: now, NotAfter: now.Add(c.life)}}}
		if got := d.expiryMargin(id); got != c.want {
			t.Errorf("%s: margin %s, want %s", c.name, got, c.want)
		}
	}
}
