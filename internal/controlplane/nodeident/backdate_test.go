package nodeident

import (
	"testing"
	"time"
)

// A certificate starts a little in the past for slow node clocks, but
// never so far that a short lifetime is over when it is issued.
func TestBackdateFor(t *testing.T) {
	for _, c := range []struct{ ttl, want time.Duration }{
		{MaxCertTTL, backdate},
		{MaxRamdiskCertTTL, backdate},
		{time.Hour, backdate},
		{10 * time.Minute, time.Minute},
		{time.Minute, 6 * time.Second},
	} {
		got := backdateFor(c.ttl)
		if got != c.want {
			t.Errorf("backdateFor(%s) = %s, want %s", c.ttl, got, c.want)
		}
		// Valid when issued, and renewed (at 60% of the lifetime, ±5%)
		// after it was issued.
		if notAfter := c.ttl - got; notAfter <= 0 || c.ttl*55/100-got <= 0 {
			t.Errorf("ttl %s: a certificate issued now ends %s from now, renews %s from now", c.ttl, notAfter, c.ttl*55/100-got)
		}
	}
}
