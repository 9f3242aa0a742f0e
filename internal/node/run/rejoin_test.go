package run_test

import (
	"strings"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/controlplane/apitest"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
	"github.com/better-compute/better-compute/internal/node/identity"
	"github.com/better-compute/better-compute/internal/shared/clock"
	"github.com/better-compute/better-compute/internal/shared/wire"
)

// R21.5: a daemon whose certificate expired while it was stopped comes
// back by itself: bcd run re-joins as the same node by x509pop through the
// real gateway and API, opens its session on the new certificate and runs
// commands. Where the control plane does not run x509pop, bcd run stops
// with what a person runs.
func TestRunRejoinsExpiredByX509PopR21_5(t *testing.T) {
	for _, tc := range []struct {
		name      string
		attestors []string
		wantOK    bool
	}{
		{name: "x509pop served", attestors: []string{wire.AttestorJoinToken, wire.AttestorX509Pop}, wantOK: true},
		{name: "x509pop not served", attestors: []string{wire.AttestorJoinToken}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			storetest.Each(t, func(t *testing.T, db *store.DB) {
				c := clock.NewFake(time.Now())
				e := apitest.Start(t, db, apitest.Options{Clock: c, Attestors: tc.attestors, CertTTL: 2 * time.Minute})
				h := newHarness(t, e, c, stackNetHTTP)
				m := h.join(t, h.token(t, h.pool(t, "p", nil), false), 86, 2)
				old := m.id

				// Stopped for three minutes: the certificate expired.
				c.Advance(3 * time.Minute)
				h.bcdAhead, h.rejoin = 3*time.Minute, true
				p := h.start(t, m)
				if !tc.wantOK {
					err := p.exited(t)
					if err == nil || !strings.Contains(err.Error(), "re-joining by x509pop failed") || !strings.Contains(err.Error(), "bcd join --reset --yes") {
						t.Fatalf("bcd run: %v, want the failed re-join and the command to run", err)
					}
					return
				}
				if id := p.welcome(t); id != m.nodeID {
					t.Fatalf("welcomed %s, want the same node %s", id, m.nodeID)
				}
				id, err := m.store.Load()
				if err != nil {
					t.Fatal(err)
				}
				if id.NodeID != old.NodeID || id.Serial == old.Serial || id.Attestor != identity.AttestorX509Pop {
					t.Errorf("after the re-join: node %s serial %s attestor %s (was %s %s)", id.NodeID, id.Serial, id.Attestor, old.NodeID, old.Serial)
				}
				cmd := h.enqueue(t, m.nodeID)
				if got := h.waitCommand(t, cmd); got.State != store.CommandDone {
					t.Errorf("command after the re-join: %s %q", got.State, got.Error)
				}
			})
		})
	}
}
