package run_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/node/renew"
	"github.com/better-compute/better-compute/internal/node/run"
	"github.com/better-compute/better-compute/internal/node/servertime"
	"github.com/better-compute/better-compute/internal/shared/clock"
)

// R19.3: with this machine's clock off the control plane's by minutes or
// an hour, a renewal through the real gateway and API is refused once for
// its client_time, corrected from the control plane's time (the Keys
// answer) and sent again; the offset is kept beside the identity, and a
// session opened afterwards by a fresh bcd (a restart) welcomes it.
func TestClockSkewR19_3(t *testing.T) {
	for _, tc := range []struct {
		skew time.Duration // the control plane's clock minus bcd's
		// refused, when set, is what the renewal fails with: a clock an
		// hour behind sees the gateway's fresh certificate as not yet
		// valid, before any answer could correct it.
		refused string
	}{
		{skew: time.Hour, refused: "clock is off the control plane's, fix NTP"},
		{skew: 3 * time.Minute},
		{skew: -3 * time.Minute},
		{skew: -time.Hour},
	} {
		skew := tc.skew
		t.Run(skew.String(), func(t *testing.T) {
			eachOn(t, defaultOnly, func(t *testing.T, h *harness) {
				m := h.join(t, h.token(t, h.pool(t, "p", nil), false), 140, 2)
				bcdClock := clock.NewFake(h.clock.Now().Add(-skew))
				cfg := *m.cfg
				r, err := renew.New(renew.Config{BCD: &cfg, Store: m.store, Clock: bcdClock, Log: quiet()})
				if err != nil {
					t.Fatal(err)
				}
				_, err = r.RenewOnce(ctxT(t))
				if tc.refused != "" {
					if err == nil || !strings.Contains(err.Error(), tc.refused) {
						t.Fatalf("renew with the clock %s off: %v, want %q", skew, err, tc.refused)
					}
					return
				}
				if err != nil {
					t.Fatalf("renew with the clock %s off: %v", skew, err)
				}
				off, _, err := servertime.Read(m.store.Dir)
				if err != nil || (off-skew).Abs() > time.Second {
					t.Fatalf("persisted offset %s (%v), want %s", off, err, skew)
				}
				// A new bcd (after a restart) keeps the offset and opens its
				// session on the renewed certificate.
				welcomes := make(chan string, 4)
				d, err := run.New(run.Config{BCD: &cfg, Store: m.store, Log: quiet(), Clock: bcdClock, Rand: func() float64 { return 0.5 },
					OnWelcome: func(id string) { welcomes <- id }})
				if err != nil {
					t.Fatal(err)
				}
				ctx, cancel := context.WithCancel(context.Background())
				done := make(chan error, 1)
				go func() { done <- d.Run(ctx) }()
				defer func() { cancel(); <-done }()
				select {
				case id := <-welcomes:
					if id != m.nodeID {
						t.Fatalf("welcomed %s", id)
					}
				case err := <-done:
					t.Fatalf("bcd run ended: %v", err)
				case <-time.After(15 * time.Second):
					t.Fatal("no Welcome")
				}
			})
		})
	}
}
