package run

import (
	"crypto/x509"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/node/identity"
)

// R19.3: the first reconnect after a session ended is drawn uniformly from
// [0, 10 s), so a fleet that lost its gateway does not come back in one
// burst; the next double from 2 s to at most 60 s, spread ±20% by the
// jitter.
func TestReconnectWait(t *testing.T) {
	for _, c := range []struct {
		n    int
		r    float64
		want time.Duration
	}{
		{1, 0, 0},
		{1, 0.25, 2500 * time.Millisecond},
		{1, 0.5, 5 * time.Second},
		{1, 0.999, 9990 * time.Millisecond},
		{0, 0.5, 5 * time.Second},
		{2, 0.5, 2 * time.Second},
		{2, 0, 1600 * time.Millisecond},
		{3, 1, 4800 * time.Millisecond},
		{7, 0.5, 60 * time.Second},
		{100, 0, 48 * time.Second},
		{100, 1, 72 * time.Second},
	} {
		if got := reconnectWait(c.n, c.r); got != c.want {
			t.Errorf("reconnectWait(%d, %v) = %s, want %s", c.n, c.r, got, c.want)
		}
	}
	// A sweep of the jitter: the first waits cover the window, in order.
	prev := time.Duration(-1)
	for i := range 100 {
		got := reconnectWait(1, (float64(i)+0.5)/100)
		if got <= prev || got < 0 || got >= FirstReconnectSpread {
			t.Fatalf("first wait %s after %s, want increasing within [0, %s)", got, prev, FirstReconnectSpread)
		}
		prev = got
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
