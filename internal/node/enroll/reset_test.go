package enroll

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/better-compute/better-compute/internal/checks/enrolltest"
	"github.com/better-compute/better-compute/internal/node/identity"
	"github.com/better-compute/better-compute/internal/shared/errs"
)

func (e *env) resetDirs(t *testing.T) []string {
	t.Helper()
	m, err := filepath.Glob(filepath.Join(e.store.Dir, "reset-*"))
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// stillOld fails unless the identity in place is old's, whole and loadable.
func stillOld(t *testing.T, e *env, old *identity.Identity) {
	t.Helper()
	cur, err := e.store.Load()
	if err != nil || cur.Serial != old.Serial || cur.NodeID != old.NodeID {
		t.Fatalf("R11.4: the identity in place: %+v %v, want node %s serial %s", cur, err, old.NodeID, old.Serial)
	}
	if d := e.resetDirs(t); len(d) != 0 {
		t.Fatalf("R11.4: left %v", d)
	}
}

// R11.4: bcd join --reset --yes with a token keeps the old identity in
// place, and loadable for bcd run, until the new one is saved; then it
// swaps them in one step and keeps the old one aside. A refused join, or a
// new identity that cannot be saved, leaves the old one as it was, and the
// refusal says what the operator needs.
func TestResetKeepsIdentityUntilJoinedR11_4(t *testing.T) {
	reset := func(token string) Options { return Options{Token: token, Reset: true} }
	joined := func(t *testing.T, e *env) *identity.Identity {
		t.Helper()
		id, err := e.joiner(e.cfg).Join(context.Background(), e.opts())
		if err != nil {
			t.Fatal(err)
		}
		return id
	}

	t.Run("refused", func(t *testing.T) {
		e := newEnv(t, envOption{})
		old := joined(t, e)
		_, err := e.joiner(e.cfg).Join(context.Background(), reset(newToken(e.now)))
		wantErr(t, "R11.4", err, errs.AccessDenied,
			"Join refused. This machine has joined before; the control plane refuses a new key for a known machine unless the token allows it: mint a token with --allow-reclaim and run bcd join --reset --yes again. The reason is recorded in the security.join.refused event.",
			"The old identity (node "+old.NodeID+") was kept in place.")
		stillOld(t, e, old)
		noPending(t, e)
	})
	t.Run("swapped once joined, usable meanwhile", func(t *testing.T) {
		e := newEnv(t, envOption{})
		old := joined(t, e)
		// While the control plane answers, bcd run still loads the old
		// identity.
		var during *identity.Identity
		var duringErr error
		e.fake.BeforeSign(func(*enrolltest.Answer) { during, duringErr = e.store.Load() })
		e.progress = nil
		id, err := e.joiner(e.cfg).Join(context.Background(), reset(e.token))
		if err != nil {
			t.Fatal(err)
		}
		if duringErr != nil || during.Serial != old.Serial {
			t.Fatalf("R11.4: during the join the identity was %v (%v)", during, duringErr)
		}
		if id.NodeID == old.NodeID || id.Serial == old.Serial || publicKeyEqual(id.Leaf().PublicKey, old.Leaf().PublicKey) {
			t.Fatal("R11.4: the new join kept the old node, certificate or key")
		}
		if cur, err := e.store.Load(); err != nil || cur.Serial != id.Serial {
			t.Fatalf("R11.4: the identity in place: %v", err)
		}
		dirs := e.resetDirs(t)
		if len(dirs) != 1 {
			t.Fatalf("R11.4: reset directories %v", dirs)
		}
		kept, err := (&identity.Store{Dir: dirs[0]}).Load()
		if err != nil || kept.Serial != old.Serial {
			t.Fatalf("R11.4: the old identity aside: %v", err)
		}
		if !hasProgress(e, "moved the old identity aside to "+dirs[0]) {
			t.Errorf("progress %q", e.progress)
		}
	})
	t.Run("the new identity cannot be saved", func(t *testing.T) {
		e := newEnv(t, envOption{})
		old := joined(t, e)
		c := e.config(e.cfg)
		c.Keys = badRecordKeys{}
		j, err := New(c)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := j.Join(context.Background(), reset(e.token)); err == nil {
			t.Fatal("saved an identity whose key record is another key")
		}
		stillOld(t, e, old)
	})
	t.Run("an expired identity", func(t *testing.T) {
		// The way back doctor names for an expired certificate, in one
		// command.
		e := newEnv(t, envOption{})
		old := e.joinExpired(t)
		id, err := e.joiner(e.cfg).Join(context.Background(), reset(e.token))
		if err != nil {
			t.Fatal(err)
		}
		if id.Expired(e.now) || id.Serial == old.Serial {
			t.Fatalf("R11.4: %+v", id)
		}
	})
	t.Run("a damaged identity", func(t *testing.T) {
		e := newEnv(t, envOption{})
		joined(t, e)
		if err := os.Remove(filepath.Join(e.store.Dir, identity.BundleFile)); err != nil {
			t.Fatal(err)
		}
		_, err := e.joiner(e.cfg).Join(context.Background(), reset(newToken(e.now)))
		wantErr(t, "R11.4", err, errs.AccessDenied, "This machine has joined before", "The old identity was kept in place in "+e.store.Dir)
		if _, err := os.Stat(filepath.Join(e.store.Dir, identity.KeyFile)); err != nil {
			t.Fatalf("R11.4: the damaged identity was touched: %v", err)
		}
		if _, err := e.joiner(e.cfg).Join(context.Background(), reset(e.token)); err != nil {
			t.Fatal(err)
		}
		if _, err := e.store.Load(); err != nil {
			t.Fatal(err)
		}
	})
	t.Run("not joined", func(t *testing.T) {
		e := newEnv(t, envOption{})
		if _, err := e.joiner(e.cfg).Join(context.Background(), reset(e.token)); err != nil {
			t.Fatal(err)
		}
		if !hasProgress(e, "nothing to reset: no identity in "+e.store.Dir) {
			t.Errorf("progress %q", e.progress)
		}
		if d := e.resetDirs(t); len(d) != 0 {
			t.Fatalf("reset directories %v", d)
		}
	})
	t.Run("x509pop", func(t *testing.T) {
		e := newEnv(t, envOption{})
		_, err := e.joiner(e.cfg).Join(context.Background(), Options{Attestor: identity.AttestorX509Pop, Reset: true})
		wantErr(t, "R11.4", err, errs.InvalidArgument, "cannot be reset first")
	})
}
