package run_test

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/controlplane/ca"
	"github.com/better-compute/better-compute/internal/controlplane/rotation"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/shared/errs"
)

var rotationSecret = []byte("run-test-rotation-secret-of-enough-length-0123456789")

// rotate runs one phase of kind's rotation and reloads the keys, as a
// replica does at its next poll.
func (h *harness) rotate(t *testing.T, ring *rotation.Ring, kind, phase string, force bool) error {
	t.Helper()
	_, err := rotation.Rotate(context.Background(), h.e.DB, h.e.Bundle, rotationSecret, rotation.Op{Kind: kind, Phase: phase, Now: time.Now(), Force: force})
	if err != nil {
		return err
	}
	if _, err := ring.Reload(context.Background()); err != nil {
		t.Fatal(err)
	}
	return nil
}

// behind is pki status's count of nodes behind kind's rotation.
func (h *harness) behind(t *testing.T, kind string) int {
	t.Helper()
	st, err := rotation.Status(context.Background(), h.e.DB, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	for _, ks := range st {
		if ks.Kind == kind {
			return ks.Behind
		}
	}
	t.Fatalf("no status for %s", kind)
	return 0
}

// R21.2: pki status counts a node as behind a rotation until its daemon
// said, in a signed Hello, that it holds the keys in force (an answer
// issued is not an answer the daemon accepted); retire refuses while a
// node is behind, naming it, unless forced; and retiring the node CA ends
// the session held on a certificate it issued, as a revocation does.
func TestPinsAckedAndNodeCARetireR21_2(t *testing.T) {
	eachOn(t, defaultOnly, func(t *testing.T, h *harness) {
		ring, err := rotation.Open(context.Background(), rotation.Config{DB: h.e.DB, Base: h.e.Bundle, Secret: rotationSecret})
		if err != nil {
			t.Fatal(err)
		}
		m := h.join(t, h.token(t, h.pool(t, "p", nil), false), 87, 2)
		p := h.start(t, m)
		p.welcome(t)
		acked := func() []string {
			var certs []store.LiveCert
			if err := h.e.DB.ReadTx(context.Background(), func(tx *store.Tx) error {
				var err error
				certs, err = tx.LiveNodeCerts(context.Background(), time.Now())
				return err
			}); err != nil {
				t.Fatal(err)
			}
			for _, c := range certs {
				if c.NodeID == m.nodeID {
					return c.PinsAck
				}
			}
			return nil
		}
		if got := acked(); !slices.Contains(got, m.cfg.JoinSigningKeyPin) || !slices.Contains(got, m.cfg.ServingCASPKIPin) {
			t.Fatalf("acknowledged pins %v, want the daemon's", got)
		}

		// A prepared join-signing key: the daemon learns it from the next
		// Welcome, and says so at the Hello after.
		if err := h.rotate(t, ring, ca.KindJoinSigning, rotation.PhasePrepare, false); err != nil {
			t.Fatal(err)
		}
		if n := h.behind(t, ca.KindJoinSigning); n != 1 {
			t.Errorf("behind after prepare = %d, want 1", n)
		}
		p.stop(t)
		p = h.start(t, m)
		p.welcome(t) // learns the statements
		p.stop(t)
		p = h.start(t, m)
		p.welcome(t) // acknowledges them
		if n := h.behind(t, ca.KindJoinSigning); n != 0 {
			t.Errorf("behind once the daemon holds the prepared key = %d, want 0 (acknowledged %v)", n, acked())
		}
		for _, phase := range []string{rotation.PhaseActivate, rotation.PhaseRetire} {
			if err := h.rotate(t, ring, ca.KindJoinSigning, phase, false); err != nil {
				t.Fatalf("join-signing %s with every node caught up: %v", phase, err)
			}
		}

		// The node CA: the session's certificate is the old CA's.
		for _, phase := range []string{rotation.PhasePrepare, rotation.PhaseActivate} {
			if err := h.rotate(t, ring, ca.KindNodeCA, phase, false); err != nil {
				t.Fatal(err)
			}
		}
		err = h.rotate(t, ring, ca.KindNodeCA, rotation.PhaseRetire, false)
		if errs.CodeOf(err) != errs.InvalidState || !strings.Contains(errs.MessageOf(err), m.nodeID) {
			t.Fatalf("node-ca retire with the node behind: %v, want INVALID_STATE naming %s", err, m.nodeID)
		}
		if err := h.rotate(t, ring, ca.KindNodeCA, rotation.PhaseRetire, true); err != nil {
			t.Fatal(err)
		}
		h.check()
		h.waitNode(t, m.nodeID, "the session on the retired node CA's certificate to end", func(n store.Node) bool {
			return n.Connection != store.Connected
		})
	})
}
