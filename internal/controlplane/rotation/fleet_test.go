package rotation_test

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/x509"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
	"github.com/better-compute/better-compute/internal/controlplane/apitest"
	"github.com/better-compute/better-compute/internal/controlplane/ca"
	"github.com/better-compute/better-compute/internal/controlplane/join"
	"github.com/better-compute/better-compute/internal/controlplane/join/jointest"
	"github.com/better-compute/better-compute/internal/controlplane/rotation"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/pki"
)

var peer = join.Peer{Addr: "192.0.2.9:40000"}

// member is a machine of the fleet as bcd holds it.
type member struct {
	id    string
	m     *jointest.Machine
	chain [][]byte
}

// R16.1: through every phase of every key, joins (sealed to the key in
// force, to the next one once prepared, to the previous one until it is
// retired) and renewals of the whole fleet succeed, every answer verifies
// under the keys in force, and once a key is retired what it made is
// refused: a seal to a retired encryption key. R21.1: a node whose
// certificate a retired node CA issued still renews, onto the new CA.
func TestFleetThroughEveryPhaseR16_1(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		ctx := context.Background()
		e := apitest.Start(t, db, apitest.Options{})
		ring, err := rotation.Open(ctx, rotation.Config{DB: db, Base: e.Bundle, Secret: secret})
		if err != nil {
			t.Fatal(err)
		}
		token := fleetToken(t, e)
		n := 0
		joinWith := func(b *ca.Bundle, enc *ecdsa.PrivateKey) *member {
			t.Helper()
			n++
			m := jointest.NewMachine(t, jointest.Claims(1000+n))
			req := m.Request(t, b, "", "")
			sb := *b
			sb.JoinEncryptionKey = enc
			req.SealedToken = jointest.Seal(t, &sb, token, req)
			res, err := e.Server.Join().Join(ctx, req, peer)
			if err != nil {
				t.Fatalf("join sealed to a key in force: %v", err)
			}
			j := m.Verify(t, b, res, pki.RoleNode)
			return &member{id: j.Body.NodeId, m: m, chain: j.Body.CertChain}
		}
		renew := func(b *ca.Bundle, h *member) error {
			t.Helper()
			req, next := jointest.RenewRequest(t, h.m.Key, h.chain, h.id, time.Now())
			res, err := e.Server.Join().Renew(ctx, req, join.Peer{Addr: peer.Addr, Cert: h.chain[0]})
			if err != nil {
				return err
			}
			j := next.VerifyRenewal(t, b, res, pki.RoleNode)
			h.m, h.chain = next, j.Body.CertChain
			return nil
		}
		var fleet []*member
		for range 4 {
			fleet = append(fleet, joinWith(e.Bundle.Now(), e.Bundle.Now().JoinEncryptionKey))
		}
		// The laggard never renews while the node CA rotates: its
		// certificate is the retired CA's.
		laggard := joinWith(e.Bundle.Now(), e.Bundle.Now().JoinEncryptionKey)
		for _, kind := range ca.Kinds {
			before := e.Bundle.Now()
			for _, phase := range []string{rotation.PhasePrepare, rotation.PhaseActivate, rotation.PhaseRetire} {
				op := rotation.Op{Kind: kind, Phase: phase, Now: time.Now()}
				if phase == rotation.PhaseRetire {
					// R21.2: the laggard is behind (and these machines
					// never open a session to say which pins they hold):
					// retire refuses, naming it, unless forced.
					_, err := rotation.Rotate(ctx, db, e.Bundle, secret, op)
					if errs.CodeOf(err) != errs.InvalidState || !strings.Contains(errs.MessageOf(err), laggard.id) || !strings.Contains(errs.MessageOf(err), "--force") {
						t.Fatalf("%s retire with nodes behind: %v", kind, err)
					}
					op.Force = true
				}
				if _, err := rotation.Rotate(ctx, db, e.Bundle, secret, op); err != nil {
					t.Fatal(err)
				}
				if _, err := ring.Reload(ctx); err != nil {
					t.Fatal(err)
				}
				b := e.Bundle.Now()
				// Every accepted encryption key opens a seal.
				for _, k := range b.OpeningKeys() {
					fleet = append(fleet, joinWith(b, k))
				}
				for _, h := range fleet {
					if err := renew(b, h); err != nil {
						t.Fatalf("%s %s: renewal of %s: %v", kind, phase, h.id, err)
					}
				}
			}
			after := e.Bundle.Now()
			if kind == ca.KindJoinEncryption {
				m := jointest.NewMachine(t, jointest.Claims(9000))
				req := m.Request(t, before, token, "")
				if _, err := e.Server.Join().Join(ctx, req, peer); err == nil {
					t.Fatal("a seal to the retired join-encryption key was opened")
				}
			}
			if kind == ca.KindNodeCA {
				if after.NodeCA.Equal(before.NodeCA) {
					t.Fatal("the node CA did not change")
				}
				// R21.1: the laggard, whose certificate the retired CA
				// issued, renews onto the new one (its row and key are
				// what the API trusts); it opens no session meanwhile.
				if err := renew(after, laggard); err != nil {
					t.Fatalf("the laggard's renewal after the node CA was retired: %v", err)
				}
				leaf, err := x509.ParseCertificate(laggard.chain[0])
				if err != nil || !bytes.Equal(leaf.AuthorityKeyId, after.NodeCA.SubjectKeyId) {
					t.Fatalf("the laggard's new certificate is not the new node CA's (%v)", err)
				}
			}
		}
	})
}

func fleetToken(t *testing.T, e *apitest.Env) string {
	t.Helper()
	ctx := context.Background()
	s, err := e.Admin.Sites.CreateSite(ctx, connect.NewRequest(&bcv1.CreateSiteRequest{TenantId: e.RootTenant, Name: "eu-1"}))
	if err != nil {
		t.Fatal(err)
	}
	pl, err := e.Admin.Pools.CreatePool(ctx, connect.NewRequest(&bcv1.CreatePoolRequest{TenantId: e.RootTenant, SiteId: s.Msg.Id, Name: "gpu", Agent: "bcd"}))
	if err != nil {
		t.Fatal(err)
	}
	tok, err := e.Admin.JoinTokens.CreateJoinToken(ctx, connect.NewRequest(&bcv1.CreateJoinTokenRequest{TenantId: e.RootTenant, PoolId: pl.Msg.Id, TtlSeconds: 3600, MaxUses: 1000}))
	if err != nil {
		t.Fatal(err)
	}
	return tok.Msg.Token
}
