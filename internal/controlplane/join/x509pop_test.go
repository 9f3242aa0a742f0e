package join_test

import (
	"bytes"
	"context"
	"crypto"
	"crypto/ecdsa"
	"crypto/x509"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
	"github.com/better-compute/better-compute/internal/controlplane/apitest"
	"github.com/better-compute/better-compute/internal/controlplane/ca"
	"github.com/better-compute/better-compute/internal/controlplane/events"
	"github.com/better-compute/better-compute/internal/controlplane/join"
	"github.com/better-compute/better-compute/internal/controlplane/join/attest"
	"github.com/better-compute/better-compute/internal/controlplane/join/attest/jointoken"
	"github.com/better-compute/better-compute/internal/controlplane/join/attest/x509pop"
	"github.com/better-compute/better-compute/internal/controlplane/join/jointest"
	"github.com/better-compute/better-compute/internal/controlplane/nodeident"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/shared/clock"
	"github.com/better-compute/better-compute/internal/shared/pki"
)

// popTTL is the certificate lifetime of the x509pop tests' JoinService.
const popTTL = time.Hour

// popEnv is a JoinService with its own fake clock running the join-token
// and x509pop attestors (R10.5).
type popEnv struct {
	f   *fixture
	clk *clock.Fake
	svc *join.Service
}

func newPopEnv(t testing.TB, f *fixture, withX509Pop bool) *popEnv {
	t.Helper()
	clk := clock.NewFake(time.Now())
	core, err := nodeident.New(nodeident.Config{DB: f.e.DB, Bundle: f.e.Bundle, Clock: clk,
		Limiter: events.NewLimiter(clk, 1000, time.Minute), CertTTL: popTTL, Hub: f.e.Server.Hub()})
	if err != nil {
		t.Fatal(err)
	}
	as := []attest.Attestor{jointoken.New()}
	if withX509Pop {
		as = append(as, x509pop.New(x509pop.Config{Core: core, NodeCAs: f.e.Bundle.TrustedNodeCAs}))
	}
	reg, err := attest.NewRegistry(as...)
	if err != nil {
		t.Fatal(err)
	}
	svc, err := join.New(join.Config{DB: f.e.DB, Core: core, Attestors: reg, Hub: f.e.Server.Hub()})
	if err != nil {
		t.Fatal(err)
	}
	return &popEnv{f: f, clk: clk, svc: svc}
}

// popNode is a node as bcd holds it after its join: its machine, key and
// chain.
type popNode struct {
	id     string
	claims *agentv1.Claims
	key    crypto.Signer
	chain  [][]byte
	// other, when set, is the node id the request names instead of id;
	// relay: a relay put it there (the evidence is not signed again).
	other string
	relay bool
}

var popMachines = 5000

// join joins a new machine into acme's pool (or pool, when set) with a token.
func (p *popEnv) join(t testing.TB, pool *bcv1.Pool, allowReclaim bool) *popNode {
	t.Helper()
	popMachines++
	m := jointest.NewMachine(t, jointest.Claims(popMachines))
	return p.joinMachine(t, m, pool, allowReclaim)
}

func (p *popEnv) joinMachine(t testing.TB, m *jointest.Machine, pool *bcv1.Pool, allowReclaim bool) *popNode {
	t.Helper()
	if pool == nil {
		pool = p.f.acmePool
	}
	tok := p.f.token(t, &bcv1.CreateJoinTokenRequest{TenantId: p.f.acme, PoolId: pool.Id, AllowReclaim: allowReclaim})
	res, err := p.svc.Join(context.Background(), m.Request(t, p.f.e.Bundle, tok.Token, ""), join.Peer{Addr: "192.0.2.7:40000"})
	if err != nil {
		t.Fatalf("join: %v", err)
	}
	j := m.VerifyAt(t, p.f.e.Bundle, res, "", p.clk.Now())
	return &popNode{id: j.Body.NodeId, claims: m.Claims, key: m.Key, chain: j.Body.CertChain}
}

// request is n's re-join request from a new key, signed by n's key at the
// fake clock's time plus skew.
func (p *popEnv) request(t testing.TB, n *popNode, skew time.Duration) (*agentv1.JoinRequest, *jointest.Machine) {
	t.Helper()
	m := jointest.NewMachine(t, n.claims)
	return m.X509PopRequest(t, n.key, n.chain, n.id, p.clk.Now().Add(skew)), m
}

// resign signs req's x509pop evidence again with n's key, as the machine
// does for the request it sends.
func (p *popEnv) resign(t testing.TB, req *agentv1.JoinRequest, n *popNode) {
	t.Helper()
	jointest.SignX509Pop(t, n.key, req)
}

func (p *popEnv) rejoin(req *agentv1.JoinRequest) (*agentv1.JoinResponse, error) {
	return p.svc.Join(context.Background(), req, join.Peer{Addr: "192.0.2.7:40002"})
}

// R10.5: a node whose certificate expired an hour ago re-joins with it: the
// same node, its next identity generation, the old certificate revoked
// (rejoined), a new valid certificate of the same role, node.joined with
// attestor x509pop and rejoin, audited as node.rejoined, and adopted again
// in the same transaction in a pool without acceptance checks (R4.5). No
// token is spent.
func TestX509PopRejoinsR10_5(t *testing.T) {
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		f := newFixture(t, e)
		p := newPopEnv(t, f, true)
		n := p.join(t, nil, false)
		oldLeaf := n.chain[0]

		p.clk.Set(mustLeaf(t, oldLeaf).NotAfter.Add(time.Hour))
		req, m := p.request(t, n, 0)
		res, err := p.rejoin(req)
		if err != nil {
			t.Fatalf("x509pop join: %v", err)
		}
		got := m.VerifyAt(t, e.Bundle, res, pki.RoleNode, p.clk.Now())
		if got.Body.NodeId != n.id {
			t.Fatalf("re-joined as %s, want the same node %s", got.Body.NodeId, n.id)
		}
		if now := p.clk.Now(); !now.Before(got.Leaf.NotAfter) || now.Before(got.Leaf.NotBefore) {
			t.Errorf("new certificate valid %s to %s, not at %s", got.Leaf.NotBefore, got.Leaf.NotAfter, now)
		}
		node := f.node(t, n.id)
		if node.IdentityGeneration != 2 || node.State != store.NodeAdopted || node.Attestor != x509pop.Name || node.TenantID != f.acme {
			t.Errorf("node %+v: want generation 2, adopted, attestor x509pop, acme's", node)
		}
		for _, c := range f.certs(t, n.id) {
			switch {
			case bytes.Equal(c.DER, oldLeaf):
				if c.RevokedAt == nil || c.RevokeReason != "rejoined" || c.IdentityGeneration != 1 {
					t.Errorf("old certificate: revoked %v (%q), generation %d; want revoked rejoined, generation 1", c.RevokedAt, c.RevokeReason, c.IdentityGeneration)
				}
			case bytes.Equal(c.DER, got.Leaf.Raw):
				if c.RevokedAt != nil || c.IdentityGeneration != 2 || c.Role != pki.RoleNode {
					t.Errorf("new certificate: revoked %v, generation %d, role %s", c.RevokedAt, c.IdentityGeneration, c.Role)
				}
			default:
				t.Errorf("unexpected certificate %s", c.Serial)
			}
		}
		if q := f.queued(t); contains(q, n.id) {
			t.Errorf("adopt queue %v holds %s, want no work", q, n.id)
		}
		if a := f.audit(t, f.acme, "node.adopted"); len(a) != 2 || a[0].Resource != "compute-node/"+n.id || a[0].Data["identityGeneration"] != float64(2) {
			t.Errorf("audit node.adopted %+v, want the newest for generation 2", a)
		}
		var revokedEv, joinedEv bool
		for _, ev := range f.events(t, f.acme, "") {
			switch {
			case ev.Type == "security.certificate-revoked" && ev.Subject == n.id:
				revokedEv = ev.Data["reason"] == "rejoined"
			case ev.Type == "node.joined" && ev.Data["attestor"] == x509pop.Name:
				joinedEv = ev.Data["nodeId"] == n.id && ev.Data["reclaim"] == false && ev.Data["rejoin"] == true &&
					ev.Data["identityGeneration"] == float64(2) && ev.Data["nodeKey"] == "unattested"
			}
		}
		if !revokedEv || !joinedEv {
			t.Errorf("events: certificate-revoked (rejoined) %v, node.joined (x509pop, rejoin) %v", revokedEv, joinedEv)
		}
		if a := f.audit(t, f.acme, "node.rejoined"); len(a) != 1 || a[0].Resource != "compute-node/"+n.id || a[0].Data["attestor"] != x509pop.Name {
			t.Errorf("audit node.rejoined %+v, want one for %s", a, n.id)
		}
		if len(jointest.Refusals(t, e.DB, f.acme))+len(jointest.Refusals(t, e.DB, f.root)) != 0 {
			t.Error("a refusal was recorded")
		}

		// The new certificate renews as usual.
		rreq, next := jointest.RenewRequest(t, m.Key, got.Body.CertChain, n.id, p.clk.Now())
		rres, err := p.svc.Renew(context.Background(), rreq, join.Peer{Cert: got.Leaf.Raw})
		if err != nil {
			t.Fatalf("renew the re-joined certificate: %v", err)
		}
		next.VerifyAt(t, e.Bundle, &agentv1.JoinResponse{Body: rres.GetBody(), Sig: rres.GetSig(), SigningCertificate: rres.GetSigningCertificate()}, pki.RoleNode, p.clk.Now())
	})
}

// R10.5: a re-join keeps the pool's acceptance policy: in a pool with
// acceptance checks the node is adopting and not queued (its first Hello
// starts acceptance), like a reclaim.
func TestX509PopRejoinAcceptancePoolR10_5(t *testing.T) {
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		f := newFixture(t, e)
		p := newPopEnv(t, f, true)
		pool := mkPool(t, f.acmeAdmin, f.acme, f.acmeSite.Id, "accept", &bcv1.PoolPolicy{Acceptance: &bcv1.AcceptancePolicy{MinCpus: 1}})
		n := p.join(t, pool, false)
		p.clk.Set(mustLeaf(t, n.chain[0]).NotAfter.Add(time.Minute))
		req, m := p.request(t, n, 0)
		res, err := p.rejoin(req)
		if err != nil {
			t.Fatalf("x509pop join: %v", err)
		}
		m.VerifyAt(t, e.Bundle, res, pki.RoleNode, p.clk.Now())
		if node := f.node(t, n.id); node.State != store.NodeAdopting || node.PoolID != pool.Id || node.IdentityGeneration != 2 {
			t.Errorf("node %+v", node)
		}
		if q := f.queued(t); contains(q, n.id) {
			t.Errorf("adopt queue %v holds %s, want it left to acceptance", q, n.id)
		}
	})
}

// R10.5: every refusal is ACCESS_DENIED "Join refused" with reason
// x509pop:<reason>, routed to the node's owner once the evidence's
// signature verified and to the root tenant before.
func TestX509PopRefusedR10_5(t *testing.T) {
	type tc struct {
		name string
		// setup runs after the join, before the clock moves; it returns the
		// node to present (n by default).
		setup func(t *testing.T, p *popEnv, n *popNode) *popNode
		// expired is how long ago the presented certificate expired
		// (negative: still valid).
		expired time.Duration
		skew    time.Duration
		// noX509Pop builds a JoinService without the attestor.
		noX509Pop bool
		// resign signs the evidence again after mod, as the machine
		// itself would for what it asks; without it a changed request is
		// what a relay would send.
		resign bool
		mod    func(t *testing.T, p *popEnv, req *agentv1.JoinRequest, m *jointest.Machine)
		root   bool
		reason string
	}
	cases := []tc{
		{name: "expired 8 days ago", expired: 8 * 24 * time.Hour, reason: "x509pop:cert-expired-too-long"},
		{name: "expired exactly 7 days ago", expired: x509pop.MaxExpiredFor, reason: "x509pop:cert-expired-too-long"},
		{name: "not yet expired", expired: -time.Minute, reason: "x509pop:cert-not-expired"},
		{name: "revoked leaf", expired: time.Hour, reason: "x509pop:cert-revoked",
			setup: func(t *testing.T, p *popEnv, n *popNode) *popNode {
				leaf := mustLeaf(t, n.chain[0])
				withTx(t, p.f.e.DB, func(tx *store.Tx) error {
					_, err := tx.RevokeNodeCert(context.Background(), pki.SerialHex(leaf), "test")
					return err
				})
				return n
			}},
		{name: "leaf of an older generation", expired: time.Hour, reason: "x509pop:cert-generation",
			setup: func(t *testing.T, p *popEnv, n *popNode) *popNode {
				// The machine reclaims its node with a token: generation 2.
				m := jointest.NewMachine(t, n.claims)
				if again := p.joinMachine(t, m, nil, true); again.id != n.id {
					t.Fatalf("reclaim made node %s, want %s", again.id, n.id)
				}
				return n
			}},
		{name: "retired node", expired: time.Hour, reason: "x509pop:node-retired",
			setup: func(t *testing.T, p *popEnv, n *popNode) *popNode {
				withTx(t, p.f.e.DB, func(tx *store.Tx) error {
					return tx.SetNodeState(context.Background(), n.id, store.NodeRetired, "test")
				})
				return n
			}},
		{name: "signature by another key", expired: time.Hour, root: true, reason: "x509pop:sig-invalid",
			setup: func(t *testing.T, p *popEnv, n *popNode) *popNode {
				return &popNode{id: n.id, claims: n.claims, key: jointest.Key(t), chain: n.chain}
			}},
		{name: "leaf not issued by JoinService", expired: time.Hour, root: true, reason: "x509pop:cert-unknown",
			setup: func(t *testing.T, p *popEnv, n *popNode) *popNode {
				b := p.f.e.Bundle
				leaf := mustLeaf(t, n.chain[0])
				c, err := ca.SignNodeCertKey(b.NodeCA, b.NodeCAKey, n.key.Public().(*ecdsa.PublicKey), ca.NodeCertParams{
					TrustDomain: b.TrustDomain, SiteID: p.f.acmeSite.Id, NodeID: n.id, Role: pki.RoleNode, NotBefore: leaf.NotBefore, NotAfter: leaf.NotAfter,
				})
				if err != nil {
					t.Fatal(err)
				}
				return &popNode{id: n.id, claims: n.claims, key: n.key, chain: [][]byte{c.DER, b.NodeCA.Raw}}
			}},
		{name: "replayed evidence", expired: time.Hour, reason: "x509pop:proof-replayed",
			mod: func(t *testing.T, p *popEnv, req *agentv1.JoinRequest, _ *jointest.Machine) {
				// The same evidence was used (by a racing join) a moment ago.
				withTx(t, p.f.e.DB, func(tx *store.Tx) error {
					_, err := tx.UseRenewProof(context.Background(), x509pop.ProofHash(pki.JoinRequestDigest(req)),
						req.NodeId, p.clk.Now(), x509pop.ProofWindow)
					return err
				})
			}},
		{name: "clock skew 61 s behind", expired: time.Hour, skew: -61 * time.Second, reason: "x509pop:client-time"},
		{name: "clock skew 61 s ahead", expired: time.Hour, skew: 61 * time.Second, reason: "x509pop:client-time"},
		{name: "attestor not configured", expired: time.Hour, noX509Pop: true, root: true, reason: "unknown:attestor-unknown"},
		{name: "pool policy without x509pop", expired: time.Hour, reason: "x509pop:pool-attestor",
			setup: func(t *testing.T, p *popEnv, n *popNode) *popNode {
				pool := mkPool(t, p.f.acmeAdmin, p.f.acme, p.f.acmeSite.Id, "tokens-only", &bcv1.PoolPolicy{JoinAttestors: []string{"join-token"}})
				return p.join(t, pool, false)
			}},
		{name: "sealed token with x509pop", expired: time.Hour, root: true, reason: "x509pop:token-present",
			mod: func(t *testing.T, p *popEnv, req *agentv1.JoinRequest, m *jointest.Machine) {
				tok := p.f.token(t, &bcv1.CreateJoinTokenRequest{TenantId: p.f.acme, PoolId: p.f.acmePool.Id})
				req.SealedToken = jointest.SealAt(t, p.f.e.Bundle, tok.Token, req, p.clk.Now())
			}},
		{name: "evidence missing", expired: time.Hour, root: true, reason: "x509pop:evidence-missing",
			mod: func(t *testing.T, p *popEnv, req *agentv1.JoinRequest, _ *jointest.Machine) { req.X509Pop = nil }},
		{name: "another role", expired: time.Hour, reason: "x509pop:role-mismatch", resign: true,
			mod: func(t *testing.T, p *popEnv, req *agentv1.JoinRequest, _ *jointest.Machine) { req.Role = pki.RoleSite }},
		{name: "another node id", expired: time.Hour, reason: "x509pop:node-id-mismatch", resign: true,
			setup: func(t *testing.T, p *popEnv, n *popNode) *popNode {
				n.other = p.join(t, nil, false).id
				return n
			}},
		// R4.2: the evidence signs the whole request; a relay changes
		// nothing in it (refused before the caller proved anything).
		{name: "relay changes the role", expired: time.Hour, root: true, reason: "x509pop:sig-invalid",
			mod: func(t *testing.T, p *popEnv, req *agentv1.JoinRequest, _ *jointest.Machine) { req.Role = pki.RoleSite }},
		{name: "relay changes the claims", expired: time.Hour, root: true, reason: "x509pop:sig-invalid",
			mod: func(t *testing.T, p *popEnv, req *agentv1.JoinRequest, _ *jointest.Machine) {
				req.Claims.ProductSerial = "SN-SWAPPED"
			}},
		{name: "relay changes the node id", expired: time.Hour, root: true, reason: "x509pop:sig-invalid",
			setup: func(t *testing.T, p *popEnv, n *popNode) *popNode {
				n.other = p.join(t, nil, false).id
				n.relay = true
				return n
			}},
		// a key from a backup taken before a renewal re-joins
		// nothing while the node holds a newer certificate.
		{name: "older key while a newer certificate exists", expired: time.Hour, reason: "x509pop:cert-superseded",
			setup: func(t *testing.T, p *popEnv, n *popNode) *popNode {
				req, _ := jointest.RenewRequest(t, n.key, n.chain, n.id, p.clk.Now())
				if _, err := p.svc.Renew(context.Background(), req, join.Peer{Addr: "192.0.2.7:40001", Cert: n.chain[0]}); err != nil {
					t.Fatalf("renew: %v", err)
				}
				return n
			}},
	}
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		f := newFixture(t, e)
		for _, c := range cases {
			t.Run(c.name, func(t *testing.T) {
				p := newPopEnv(t, f, !c.noX509Pop)
				n := p.join(t, nil, false)
				if c.setup != nil {
					n = c.setup(t, p, n)
				}
				p.clk.Set(mustLeaf(t, n.chain[0]).NotAfter.Add(c.expired))
				req, m := p.request(t, n, c.skew)
				if n.other != "" {
					req.NodeId = n.other
					if !n.relay {
						p.resign(t, req, n)
					}
				}
				if c.mod != nil {
					c.mod(t, p, req, m)
				}
				if c.resign {
					p.resign(t, req, n)
				}
				tenant := f.acme
				if c.root {
					tenant = f.root
				}
				gen := f.node(t, n.id).IdentityGeneration
				f.refusedOnce(t, tenant, c.reason, func() error { _, err := p.rejoin(req); return err })
				if after := f.node(t, n.id).IdentityGeneration; after != gen {
					t.Errorf("identity generation moved from %d to %d on a refusal", gen, after)
				}
			})
		}
	})
}

// R10.5: the evidence cannot be replayed once it re-joined its node: the
// leaf it presents is then of an older generation.
func TestX509PopReplayAfterRejoinR10_5(t *testing.T) {
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		f := newFixture(t, e)
		p := newPopEnv(t, f, true)
		n := p.join(t, nil, false)
		p.clk.Set(mustLeaf(t, n.chain[0]).NotAfter.Add(time.Hour))
		req, _ := p.request(t, n, 0)
		first, err := p.rejoin(req)
		if err != nil {
			t.Fatalf("x509pop join: %v", err)
		}
		// R4.9: the same request again gets the answer stored for it and
		// changes nothing; evidence re-signed into another request is a
		// leaf of an older generation.
		res, err := p.rejoin(req)
		if err != nil {
			t.Fatalf("the same x509pop request again: %v", err)
		}
		if !proto.Equal(res, first) {
			t.Error("the same request got another answer")
		}
		if g := f.node(t, n.id).IdentityGeneration; g != 2 {
			t.Errorf("generation %d, want 2", g)
		}
		req.Claims.Hostname = "another"
		p.resign(t, req, n)
		f.refusedOnce(t, f.acme, "x509pop:cert-generation", func() error { _, err := p.rejoin(req); return err })
		if g := f.node(t, n.id).IdentityGeneration; g != 2 {
			t.Errorf("generation %d, want 2", g)
		}
	})
}

func mustLeaf(t *testing.T, der []byte) *x509.Certificate {
	t.Helper()
	c, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func withTx(t *testing.T, db *store.DB, fn func(tx *store.Tx) error) {
	t.Helper()
	if err := db.WithTx(context.Background(), fn); err != nil {
		t.Fatal(err)
	}
}
