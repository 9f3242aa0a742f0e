package run

import (
	"crypto/x509"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/node/identity"
)

// R19.3: the reconnect wait doubles from 1 s to at most 60 s, spread ±20%
// by the jitter, so a fleet that lost its gateway does not come back in
// one burst.
func TestReconnectWait(t *testing.T) {
	for _, c := range []struct {
		n    int
		r    float64
		want time.Duration
	}{
		{1, 0.5, time.Second},
		{1, 0, 800 * time.Millisecond},
		{2, 0.5, 2 * time.Second},
		{3, 1, 4800 * time.Millisecond},
		{7, 0.5, 60 * time.Second},
		{100, 0, 48 * time.Second},
		{100, 1, 72 * time.Second},
	} {
		if got := reconnectWait(c.n, c.r); got != c.want {
			t.Errorf("reconnectWait(%d, %v) = %s, want %s", c.n, c.r, got, c.want)
		}
	}
}

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
		{"before any Welcome", 0, 24 * time.Hour, defaultHeartbeat},
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
