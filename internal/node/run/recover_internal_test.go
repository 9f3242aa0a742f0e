package run

import (
	"testing"
	"time"
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
