package enroll

import (
	"context"
	"crypto"
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/checks/enrolltest"
	"github.com/better-compute/better-compute/internal/node/identity"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/ids"
	"github.com/better-compute/better-compute/internal/shared/pki"
)

// joinExpired joins with the token and a certificate that expired a minute
// before the env's time (inside the fake PKI's validity), as a machine
// holds it after a few days offline.
func (e *env) joinExpired(t *testing.T) *identity.Identity {
	t.Helper()
	e.fake.BeforeSign(func(a *enrolltest.Answer) {
		a.Params.NotBefore, a.Params.NotAfter = e.now.Add(-4*time.Minute), e.now.Add(-time.Minute)
	})
	id, err := e.joiner(e.cfg).Join(context.Background(), e.opts())
	if err != nil {
		t.Fatal(err)
	}
	e.fake.BeforeSign(nil)
	if !id.Expired(e.now) {
		t.Fatal("the identity has not expired")
	}
	return id
}

// badRecordKeys makes a key whose record holds another key, so Save
// refuses the identity.
type badRecordKeys struct{ identity.SoftwareKeys }

func (k badRecordKeys) GenerateKey() (crypto.Signer, []byte, error) {
	s, _, err := k.SoftwareKeys.GenerateKey()
	if err != nil {
		return nil, nil, err
	}
	_, other, err := k.SoftwareKeys.GenerateKey()
	return s, other, err
}

// R10.5: bcd join --attestor x509pop sends no token, the expired chain and
// a proof signed by its key for the new CSR, checks the answer like any
// join, and only then replaces the identity, keeping the expired one aside.
func TestRejoinX509PopR10_5(t *testing.T) {
	e := newEnv(t, envOption{})
	old := e.joinExpired(t)
	id, err := e.joiner(e.cfg).Join(context.Background(), Options{Attestor: identity.AttestorX509Pop})
	if err != nil {
		t.Fatal(err)
	}
	if id.NodeID != old.NodeID || id.Serial == old.Serial || id.Expired(e.now) || id.Attestor != identity.AttestorX509Pop ||
		id.Leaf().PublicKey.(interface{ Equal(crypto.PublicKey) bool }).Equal(old.Leaf().PublicKey) {
		t.Fatalf("identity %+v after re-joining %+v", id, old)
	}
	req := e.fake.LastRequest()
	ev := req.GetX509Pop()
	switch {
	case req.GetAttestor() != "x509pop" || req.GetSealedToken() != "" || req.GetNodeId() != old.NodeID || req.GetRole() != pki.RoleNode:
		t.Errorf("request %v", req)
	case ev == nil || len(ev.GetChain()) != 2 || string(ev.GetChain()[0]) != string(old.Leaf().Raw):
		t.Errorf("evidence %v, want the expired chain", ev)
	case pki.VerifyX509Pop(old.Leaf().PublicKey, pki.JoinRequestDigest(req), ev.GetSig()) != nil:
		t.Error("R4.2: the evidence does not sign the request's digest with the expired certificate's key")
	case ev.GetClientTimeUnixMs() != e.now.UnixMilli():
		t.Errorf("client time %d, want %d", ev.GetClientTimeUnixMs(), e.now.UnixMilli())
	}
	aside, _ := filepath.Glob(filepath.Join(e.store.Dir, "reset-*"))
	if len(aside) != 1 {
		t.Fatalf("kept aside: %v", aside)
	}
	kept, err := (&identity.Store{Dir: aside[0]}).Load()
	if err != nil || kept.Serial != old.Serial {
		t.Errorf("the identity kept aside: %v", err)
	}
}

// R10.5: nothing is lost when the answer fails its checks or the new
// identity cannot be saved, and bcd refuses locally when there is nothing
// to re-join with.
func TestRejoinX509PopKeepsIdentityR10_5(t *testing.T) {
	t.Run("answer for another node", func(t *testing.T) {
		e := newEnv(t, envOption{})
		old := e.joinExpired(t)
		e.fake.BeforeSign(func(a *enrolltest.Answer) { a.Params.NodeID = ids.New(ids.Node, e.now) })
		_, err := e.joiner(e.cfg).Join(context.Background(), Options{Attestor: identity.AttestorX509Pop})
		wantErr(t, "R10.5", err, errs.Unauthenticated, "re-join response", "not this node "+old.NodeID, "expired identity is kept")
		if cur, err := e.store.Load(); err != nil || cur.Serial != old.Serial {
			t.Fatalf("identity %v (%v), want the expired one", cur, err)
		}
	})
	t.Run("save fails", func(t *testing.T) {
		e := newEnv(t, envOption{})
		old := e.joinExpired(t)
		c := e.config(e.cfg)
		c.Keys = badRecordKeys{}
		j, err := New(c)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := j.Join(context.Background(), Options{Attestor: identity.AttestorX509Pop}); err == nil {
			t.Fatal("saved an identity whose key record is another key")
		}
		if cur, err := e.store.Load(); err != nil || cur.Serial != old.Serial {
			t.Fatalf("identity %v (%v), want the expired one back", cur, err)
		}
		if aside, _ := filepath.Glob(filepath.Join(e.store.Dir, "reset-*")); len(aside) != 0 {
			t.Errorf("left %v behind", aside)
		}
	})
	t.Run("still valid", func(t *testing.T) {
		e := newEnv(t, envOption{})
		if _, err := e.joiner(e.cfg).Join(context.Background(), e.opts()); err != nil {
			t.Fatal(err)
		}
		calls := e.fake.Calls()
		_, err := e.joiner(e.cfg).Join(context.Background(), Options{Attestor: identity.AttestorX509Pop})
		wantErr(t, "R10.5", err, errs.InvalidState, "the certificate is still valid: bcd renews it; run bcd renew")
		if e.fake.Calls() != calls {
			t.Error("the request was sent")
		}
	})
	t.Run("not joined", func(t *testing.T) {
		e := newEnv(t, envOption{})
		_, err := e.joiner(e.cfg).Join(context.Background(), Options{Attestor: identity.AttestorX509Pop})
		wantErr(t, "R10.5", err, errs.InvalidState, "no identity in")
		if e.fake.Calls() != 0 {
			t.Error("the request was sent")
		}
		if _, err := os.Stat(e.store.Dir); err == nil {
			if _, lerr := e.store.Load(); !errors.Is(lerr, identity.ErrNotJoined) {
				t.Errorf("load: %v", lerr)
			}
		}
	})
}
