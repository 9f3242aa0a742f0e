package renew_test

import (
	"context"
	"errors"
	"net/http"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/controlplane/api"
	"github.com/better-compute/better-compute/internal/controlplane/apitest"
	"github.com/better-compute/better-compute/internal/controlplane/join/attest/tpm"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/node/identity"
	"github.com/better-compute/better-compute/internal/node/renew"
	"github.com/better-compute/better-compute/internal/node/tpmdevice"
	"github.com/better-compute/better-compute/internal/node/tpmdevice/tpmtest"
	"github.com/better-compute/better-compute/internal/node/tpmkeys"
	"github.com/better-compute/better-compute/internal/shared/tpmverify"
	"github.com/better-compute/better-compute/internal/shared/wire"
)

// tpmAgent is a second API replica on e's database and PKI whose JoinService
// also runs the tpm attestor, trusting for pool the EKs sim's local CA
// certified (the serve config's [[join.tpm.pools]]). Its agent handler
// serves the stack.
func tpmAgent(t *testing.T, e *apitest.Env, pool string, sim *tpmtest.Sim) http.Handler {
	t.Helper()
	cas, err := tpmverify.LoadCAs(sim.CAFiles)
	if err != nil {
		t.Fatal(err)
	}
	srv, err := api.New(api.Config{DB: e.DB, Bundle: e.Bundle, Log: quiet,
		Attestors: []string{wire.AttestorJoinToken, wire.AttestorTPM},
		TPMPools:  []tpm.Pool{{PoolID: pool, Trust: tpmverify.Trust{CAs: cas}}}})
	if err != nil {
		t.Fatal(err)
	}
	return srv.AgentHandler()
}

// R9.1, R13.3: the node key of a tpm join lives in the TPM across a bcd
// restart and an swtpm restart (transient objects gone, seeds kept): each
// time a new bcd reopens node.key's record from config.toml's [tpm], the
// renewal loop renews once with the AK's certify of the next key (made in
// the TPM too), and the renewed certificate keeps the AK statement.
func TestTPMNodeKeySurvivesRestartsR9_1(t *testing.T) {
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		sim := tpmtest.Start(t)
		s := newStackWith(t, e, stackOptions{sim: sim})
		leaf := s.joined.Leaf()
		if len(leaf.URIs) != 2 || !tpmverify.IsStatement(leaf.URIs[1].String()) || s.joined.Attestor != identity.AttestorTPM {
			t.Fatalf("joined %s with URIs %v, want a tpm join with the AK statement", s.joined.Attestor, leaf.URIs)
		}
		stmt := leaf.URIs[1].String()
		prev := s.joined

		// One bcd process: its stores from config.toml, one round of the
		// renewal loop (the first wait is until the renewal is due; the
		// second, after it, ends the loop).
		restartAndRenew := func(when string) {
			t.Helper()
			keys, st, err := tpmkeys.Stores(s.cfg, s.cfg.DataDir)
			if err != nil {
				t.Fatalf("%s: open the TPM: %v", when, err)
			}
			loaded, err := st.Load()
			if err != nil {
				t.Fatalf("%s: the identity does not load: %v", when, err)
			}
			if _, ok := loaded.Signer.(*tpmdevice.Key); !ok || loaded.Serial != prev.Serial {
				t.Fatalf("%s: loaded %T serial %s, want the TPM key of serial %s", when, loaded.Signer, loaded.Serial, prev.Serial)
			}
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			waits := 0
			r := s.renewer(t, func(c *renew.Config) {
				c.Store, c.Keys = st, keys
				c.Sleep = func(ctx context.Context, _ time.Duration) error {
					if waits++; waits == 2 {
						cancel()
					}
					return ctx.Err()
				}
			})
			if err := r.Loop(ctx); !errors.Is(err, context.Canceled) {
				t.Fatalf("%s: renewal loop: %v", when, err)
			}
			got, err := st.Load()
			if err != nil {
				t.Fatalf("%s: the renewed identity does not load: %v", when, err)
			}
			gl := got.Leaf()
			if got.Serial == prev.Serial || got.NodeID != prev.NodeID || keyOf(t, got).Equal(keyOf(t, prev)) {
				t.Fatalf("%s: serial %s (was %s), node %s: want a new certificate for a new key of the same node", when, got.Serial, prev.Serial, got.NodeID)
			}
			if len(gl.URIs) != 2 || gl.URIs[1].String() != stmt {
				t.Fatalf("%s: the renewed certificate's URIs %v, want the statement %s kept", when, gl.URIs, stmt)
			}
			rec, err := os.ReadFile(filepath.Join(s.cfg.DataDir, identity.KeyFile))
			if err != nil || identity.RecordKind(rec) != identity.KindTPM {
				t.Fatalf("%s: node.key is not a TPM key record: %v", when, err)
			}
			if n, err := keys.(*tpmkeys.Keys).TPM.TransientHandles(); err != nil || n != 0 {
				t.Fatalf("%s: %d transient handles left in the TPM (%v), want 0", when, n, err)
			}
			prev = got
		}

		restartAndRenew("after a bcd restart")
		sim.Restart(t)
		s.cfg.TPM.Simulator = sim.Addr // swtpm's new command port
		restartAndRenew("after an swtpm restart")
		if n := len(s.certs(t, prev.NodeID)); n != 3 {
			t.Fatalf("%d node_certs rows, want 3 (the join and two renewals)", n)
		}
	})
}

// R9.1, R9.2: bcd's token join on a TPM host makes the node key in the TPM
// all the same (node.key is its record), but the node says nodeKey
// unattested and its certificate names no AK; it renews without an
// attestation, the next key made in the TPM too.
func TestTPMHostTokenJoinR9_2(t *testing.T) {
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		s := newStackWith(t, e, stackOptions{sim: tpmtest.Start(t), token: true})
		rec, err := os.ReadFile(filepath.Join(s.cfg.DataDir, identity.KeyFile))
		if err != nil || identity.RecordKind(rec) != identity.KindTPM {
			t.Fatalf("node.key after a token join on a TPM host is not a TPM key record: %v", err)
		}
		if u := s.joined.Leaf().URIs; len(u) != 1 || s.joined.Attestor != identity.AttestorJoinToken {
			t.Fatalf("joined by %s with URIs %v, want a token join with the SPIFFE ID only", s.joined.Attestor, u)
		}
		var n store.Node
		if err := e.DB.ReadTx(context.Background(), func(tx *store.Tx) (err error) {
			n, err = tx.GetNode(context.Background(), s.joined.NodeID)
			return err
		}); err != nil {
			t.Fatal(err)
		}
		if n.NodeKey != "unattested" {
			t.Fatalf("node key %q, want unattested", n.NodeKey)
		}
		keys, st, err := tpmkeys.Stores(s.cfg, s.cfg.DataDir)
		if err != nil {
			t.Fatal(err)
		}
		got, err := s.renewer(t, func(c *renew.Config) { c.Store, c.Keys = st, keys }).RenewOnce(context.Background())
		if err != nil {
			t.Fatalf("renewal of an unattested TPM key: %v", err)
		}
		if _, ok := got.Signer.(*tpmdevice.Key); !ok || len(got.Leaf().URIs) != 1 || got.Serial == s.joined.Serial {
			t.Fatalf("renewed %T serial %s with URIs %v, want a new TPM key and no statement", got.Signer, got.Serial, got.Leaf().URIs)
		}
	})
}
