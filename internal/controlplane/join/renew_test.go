package join_test

import (
	"bytes"
	"context"
	"crypto"
	"crypto/ecdsa"
	"crypto/rand"
	"crypto/x509"
	"encoding/json"
	"slices"
	"testing"
	"time"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
	"github.com/better-compute/better-compute/internal/controlplane/apitest"
	"github.com/better-compute/better-compute/internal/controlplane/ca"
	"github.com/better-compute/better-compute/internal/controlplane/events"
	"github.com/better-compute/better-compute/internal/controlplane/join"
	"github.com/better-compute/better-compute/internal/controlplane/join/jointest"
	"github.com/better-compute/better-compute/internal/controlplane/nodeident"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/shared/clock"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/pki"
	"github.com/better-compute/better-compute/internal/shared/tpmverify"
)

// renewEnv is one JoinService with its own fake clock, for the renewal
// tests: every case joins its own node in acme's pool, so owner routing
// (acme) and root routing are told apart.
type renewEnv struct {
	f   *fixture
	clk *clock.Fake
	svc *join.Service
}

func newRenewEnv(t testing.TB, f *fixture) *renewEnv {
	t.Helper()
	clk := clock.NewFake(time.Now())
	return &renewEnv{f: f, clk: clk, svc: ownService(t, f.e, clk, events.NewLimiter(clk, 1000, time.Minute), 0)}
}

// renewNode is a joined node as bcd holds it: its key and chain.
type renewNode struct {
	id    string
	key   crypto.Signer
	chain [][]byte
	leaf  []byte
}

var renewMachines = 1000

// join joins a new machine through r.svc with a token of tenant's pool
// (root or acme).
func (r *renewEnv) join(t testing.TB, tenant string, req *bcv1.CreateJoinTokenRequest) *renewNode {
	t.Helper()
	renewMachines++
	m := jointest.NewMachine(t, jointest.Claims(renewMachines))
	return r.joinMachine(t, m, tenant, req)
}

func (r *renewEnv) joinMachine(t testing.TB, m *jointest.Machine, tenant string, req *bcv1.CreateJoinTokenRequest) *renewNode {
	t.Helper()
	if req == nil {
		req = &bcv1.CreateJoinTokenRequest{}
	}
	if tenant == r.f.acme {
		req.TenantId, req.PoolId = r.f.acme, r.f.acmePool.Id
	}
	tok := r.f.token(t, req)
	res, err := r.svc.Join(context.Background(), m.Request(t, r.f.e.Bundle, tok.Token, ""), join.Peer{Addr: "192.0.2.7:40000"})
	if err != nil {
		t.Fatalf("join: %v", err)
	}
	j := m.Verify(t, r.f.e.Bundle, res, "")
	return &renewNode{id: j.Body.NodeId, key: m.Key, chain: j.Body.CertChain, leaf: j.Body.CertChain[0]}
}

// request is n's renewal request at the fake clock's time.
func (r *renewEnv) request(t testing.TB, n *renewNode) (*agentv1.RenewRequest, *jointest.Machine) {
	t.Helper()
	return jointest.RenewRequest(t, n.key, n.chain, n.id, r.clk.Now())
}

func (r *renewEnv) renew(req *agentv1.RenewRequest, peerCert []byte) (*agentv1.RenewResponse, error) {
	return r.svc.Renew(context.Background(), req, join.Peer{Addr: "192.0.2.7:40001", Cert: peerCert})
}

// R13.1, R13.4: a renewal through the real service issues a new node_certs
// row of the same generation, role, allowed kinds and statements, audits
// it and announces it to the node's tenant; the renewed certificate renews
// again.
func TestRenewIssuesR13_1(t *testing.T) {
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		f := newFixture(t, e)
		r := newRenewEnv(t, f)
		n := r.join(t, f.acme, nil)

		req, next := r.request(t, n)
		res, err := r.renew(req, n.leaf)
		if err != nil {
			t.Fatalf("renew: %v", err)
		}
		got := next.VerifyRenewal(t, e.Bundle, res, pki.RoleNode)
		if got.Body.NodeId != n.id || bytes.Equal(got.Leaf.Raw, n.leaf) {
			t.Fatalf("renewed node %s (leaf unchanged: %v), want a new certificate of %s", got.Body.NodeId, bytes.Equal(got.Leaf.Raw, n.leaf), n.id)
		}
		if lifetime := got.Leaf.NotAfter.Sub(got.Leaf.NotBefore); lifetime != join.MaxCertTTL {
			t.Errorf("lifetime %s, want %s", lifetime, join.MaxCertTTL)
		}
		certs := f.certs(t, n.id)
		if len(certs) != 2 {
			t.Fatalf("%d node_certs rows, want 2", len(certs))
		}
		for _, c := range certs {
			if c.IdentityGeneration != 1 || c.Role != pki.RoleNode || c.RevokedAt != nil {
				t.Errorf("cert %s: generation %d role %s revoked %v, want 1, node, unrevoked", c.Serial, c.IdentityGeneration, c.Role, c.RevokedAt)
			}
		}
		if !slices.ContainsFunc(certs, func(c store.NodeCert) bool { return bytes.Equal(c.DER, got.Leaf.Raw) }) {
			t.Error("the renewed certificate is not a node_certs row")
		}
		evs := f.events(t, f.acme, "node.certificate-renewed")
		if len(evs) != 1 || evs[0].Subject != n.id || evs[0].Data["certSerial"] != pki.SerialHex(got.Leaf) || evs[0].Data["identityGeneration"] != float64(1) {
			t.Errorf("node.certificate-renewed events %+v", evs)
		}
		if rows := f.audit(t, f.acme, "node.certificate-renewed"); len(rows) != 1 || rows[0].Actor != "node:"+n.id || rows[0].Resource != "compute-node/"+n.id {
			t.Errorf("audit rows %+v", rows)
		}

		// The renewed identity renews in turn (its own mTLS identity).
		n2 := &renewNode{id: n.id, key: next.Key, chain: got.Body.CertChain, leaf: got.Leaf.Raw}
		req2, next2 := r.request(t, n2)
		res2, err := r.renew(req2, n2.leaf)
		if err != nil {
			t.Fatalf("second renew: %v", err)
		}
		next2.VerifyRenewal(t, e.Bundle, res2, pki.RoleNode)
	})
}

// R13.4: role, allowed kinds and statements come from the stored row, and
// a ramdisk renews for at most 2 h.
func TestRenewKeepsStoredPolicyR13_4(t *testing.T) {
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		f := newFixture(t, e)
		r := newRenewEnv(t, f)
		n := r.join(t, f.acme, nil)
		// A certificate as an attestor with policy would have issued:
		// another role, a statement, allowed kinds.
		stored := r.storeCert(t, n, pki.RoleRamdisk, []string{"urn:bc:example:1"}, `["exec.*"]`, 24*time.Hour)

		req, next := jointest.RenewRequest(t, n.key, [][]byte{stored.DER, e.Bundle.NodeCA.Raw}, n.id, r.clk.Now())
		res, err := r.renew(req, stored.DER)
		if err != nil {
			t.Fatalf("renew: %v", err)
		}
		got := next.VerifyRenewal(t, e.Bundle, res, pki.RoleRamdisk)
		if !slices.Equal(got.Identity.Statements, []string{"urn:bc:example:1"}) {
			t.Errorf("statements %v", got.Identity.Statements)
		}
		if lifetime := got.Leaf.NotAfter.Sub(got.Leaf.NotBefore); lifetime > join.MaxRamdiskCertTTL {
			t.Errorf("ramdisk lifetime %s, want at most %s", lifetime, join.MaxRamdiskCertTTL)
		}
		var row store.NodeCert
		f.read(t, func(tx *store.Tx) (err error) {
			row, err = tx.GetNodeCert(context.Background(), pki.SerialHex(got.Leaf))
			return
		})
		if string(row.AllowedKinds) != `["exec.*"]` || string(row.Statements) != `["urn:bc:example:1"]` || row.Role != pki.RoleRamdisk {
			t.Errorf("renewed row kinds %s statements %s role %s", row.AllowedKinds, row.Statements, row.Role)
		}
	})
}

// storeCert issues n another certificate for its key with the given policy
// and records it, as an attestor's join would have.
func (r *renewEnv) storeCert(t testing.TB, n *renewNode, role string, statements []string, kinds string, ttl time.Duration) *ca.NodeCert {
	t.Helper()
	b := r.f.e.Bundle
	leaf, err := x509.ParseCertificate(n.leaf)
	if err != nil {
		t.Fatal(err)
	}
	id, err := pki.NodeIdentityOf(leaf)
	if err != nil {
		t.Fatal(err)
	}
	nb := r.clk.Now().Add(-time.Minute)
	if role == pki.RoleRamdisk {
		ttl = min(ttl, join.MaxRamdiskCertTTL)
	}
	nc, err := ca.SignNodeCertKey(b.NodeCA, b.NodeCAKey, n.key.Public().(*ecdsa.PublicKey), ca.NodeCertParams{
		TrustDomain: b.TrustDomain, SiteID: id.SiteID, NodeID: n.id, Role: role, Statements: statements, NotBefore: nb, NotAfter: nb.Add(ttl),
	})
	if err != nil {
		t.Fatal(err)
	}
	stmts, _ := json.Marshal(statements)
	err = r.f.e.DB.WithTx(context.Background(), func(tx *store.Tx) error {
		return tx.InsertNodeCert(context.Background(), store.NodeCert{Serial: nc.Serial, NodeID: n.id, IdentityGeneration: 1, Role: role,
			SPKISHA256: nc.SPKISHA256, DER: nc.DER, AllowedKinds: []byte(kinds), Statements: stmts, NotBefore: nc.Cert.NotBefore, NotAfter: nc.Cert.NotAfter})
	})
	if err != nil {
		t.Fatal(err)
	}
	return nc
}

// R13.2, R13.3, R13.5: every refusal answers ACCESS_DENIED "Renew refused",
// writes nothing but one security.renew.refused event with the reason, to
// the node's owner once the caller proved the current key and to the root
// tenant before.
func TestRenewRefusalsR13_2(t *testing.T) {
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		f := newFixture(t, e)
		type setup struct {
			req  *agentv1.RenewRequest
			peer []byte
			node string
		}
		cases := []struct {
			name   string
			reason string
			owner  bool // routed to acme (the node's owner), else root
			do     func(t *testing.T, r *renewEnv) setup
		}{
			// The same renewal again: its leaf was superseded by the
			// first, so the replay is refused before its proof is looked
			// at (the proof record stays as a second line).
			{"R13.2 proof replayed within 120 s", "cert-superseded", true, func(t *testing.T, r *renewEnv) setup {
				n := r.join(t, f.acme, nil)
				req, _ := r.request(t, n)
				if _, err := r.renew(req, n.leaf); err != nil {
					t.Fatalf("first use: %v", err)
				}
				r.clk.Advance(59 * time.Second)
				return setup{req, n.leaf, n.id}
			}},
			// a renewal supersedes its parent; a fresh proof from
			// the parent renews nothing (20 renewals from one certificate
			// left 21 valid certificates).
			{"R13.2 renewal from a superseded certificate", "cert-superseded", true, func(t *testing.T, r *renewEnv) setup {
				n := r.join(t, f.acme, nil)
				req, _ := r.request(t, n)
				if _, err := r.renew(req, n.leaf); err != nil {
					t.Fatalf("first renewal: %v", err)
				}
				r.clk.Advance(time.Second)
				again, _ := r.request(t, n)
				return setup{again, n.leaf, n.id}
			}},
			{"R13.2 client_time 61 s ahead", "client-time", true, func(t *testing.T, r *renewEnv) setup {
				n := r.join(t, f.acme, nil)
				req, _ := jointest.RenewRequest(t, n.key, n.chain, n.id, r.clk.Now().Add(61*time.Second))
				return setup{req, n.leaf, n.id}
			}},
			{"R13.2 client_time 61 s behind", "client-time", true, func(t *testing.T, r *renewEnv) setup {
				n := r.join(t, f.acme, nil)
				req, _ := jointest.RenewRequest(t, n.key, n.chain, n.id, r.clk.Now().Add(-61*time.Second))
				return setup{req, n.leaf, n.id}
			}},
			{"R13.2 leaf of an older identity generation (reclaimed)", "cert-generation", true, func(t *testing.T, r *renewEnv) setup {
				renewMachines++
				claims := jointest.Claims(renewMachines)
				old := r.joinMachine(t, jointest.NewMachine(t, claims), f.acme, nil)
				cur := r.joinMachine(t, jointest.NewMachine(t, claims), f.acme, &bcv1.CreateJoinTokenRequest{AllowReclaim: true})
				if cur.id != old.id {
					t.Fatalf("reclaim made node %s, want %s", cur.id, old.id)
				}
				req, _ := r.request(t, old)
				return setup{req, old.leaf, old.id}
			}},
			{"R13.2 leaf re-signed with the same serial", "cert-unknown", false, func(t *testing.T, r *renewEnv) setup {
				n := r.join(t, f.acme, nil)
				leaf, err := x509.ParseCertificate(n.leaf)
				if err != nil {
					t.Fatal(err)
				}
				// The same template signed again by the node CA: valid,
				// same serial, other bytes.
				der, err := x509.CreateCertificate(rand.Reader, leaf, e.Bundle.NodeCA, leaf.PublicKey, e.Bundle.NodeCAKey)
				if err != nil {
					t.Fatal(err)
				}
				req, _ := jointest.RenewRequest(t, n.key, [][]byte{der, e.Bundle.NodeCA.Raw}, n.id, r.clk.Now())
				return setup{req, der, ""}
			}},
			{"R13.2 leaf with a flipped byte in its signature", "cert-unknown", false, func(t *testing.T, r *renewEnv) setup {
				n := r.join(t, f.acme, nil)
				der := bytes.Clone(n.leaf)
				der[len(der)-1] ^= 1
				req, _ := jointest.RenewRequest(t, n.key, [][]byte{der, e.Bundle.NodeCA.Raw}, n.id, r.clk.Now())
				return setup{req, n.leaf, ""}
			}},
			{"R13.2 revoked leaf", "cert-revoked", true, func(t *testing.T, r *renewEnv) setup {
				n := r.join(t, f.acme, nil)
				r.write(t, func(tx *store.Tx) error {
					_, err := tx.RevokeNodeCert(context.Background(), pki.SerialHex(mustParse(t, n.leaf)), "test")
					return err
				})
				req, _ := r.request(t, n)
				return setup{req, n.leaf, n.id}
			}},
			{"R13.2 expired leaf", "cert-expired", true, func(t *testing.T, r *renewEnv) setup {
				n := r.join(t, f.acme, nil)
				r.clk.Advance(join.MaxCertTTL)
				req, _ := r.request(t, n)
				return setup{req, n.leaf, n.id}
			}},
			{"R13.2 retired node", "node-retired", true, func(t *testing.T, r *renewEnv) setup {
				n := r.join(t, f.acme, nil)
				r.write(t, func(tx *store.Tx) error {
					return tx.SetNodeState(context.Background(), n.id, store.NodeRetired, "test")
				})
				req, _ := r.request(t, n)
				return setup{req, n.leaf, n.id}
			}},
			{"R13.2 mTLS identity of another node", "peer-node", true, func(t *testing.T, r *renewEnv) setup {
				n := r.join(t, f.acme, nil)
				other := r.join(t, f.acme, nil)
				req, _ := r.request(t, n)
				return setup{req, other.leaf, n.id}
			}},
			{"R13.2 no mTLS identity", "peer-missing", true, func(t *testing.T, r *renewEnv) setup {
				n := r.join(t, f.acme, nil)
				req, _ := r.request(t, n)
				return setup{req, nil, n.id}
			}},
			{"R13.2 mTLS certificate not issued (re-signed)", "peer-unknown", true, func(t *testing.T, r *renewEnv) setup {
				n := r.join(t, f.acme, nil)
				leaf := mustParse(t, n.leaf)
				der, err := x509.CreateCertificate(rand.Reader, leaf, e.Bundle.NodeCA, leaf.PublicKey, e.Bundle.NodeCAKey)
				if err != nil {
					t.Fatal(err)
				}
				req, _ := r.request(t, n)
				return setup{req, der, n.id}
			}},
			{"R13.1 pop_sig by another key", "pop-invalid", false, func(t *testing.T, r *renewEnv) setup {
				n := r.join(t, f.acme, nil)
				req, _ := jointest.RenewRequest(t, jointest.Key(t), n.chain, n.id, r.clk.Now())
				return setup{req, n.leaf, n.id}
			}},
			{"R13.1 node_id not the leaf's node", "node-id-mismatch", true, func(t *testing.T, r *renewEnv) setup {
				n := r.join(t, f.acme, nil)
				other := r.join(t, f.acme, nil)
				req, _ := jointest.RenewRequest(t, n.key, n.chain, other.id, r.clk.Now())
				return setup{req, n.leaf, n.id}
			}},
			{"R13.1 CSR not a P-256 request", "csr-invalid", false, func(t *testing.T, r *renewEnv) setup {
				n := r.join(t, f.acme, nil)
				req, _ := r.request(t, n)
				req.Csr = []byte("not a csr")
				return setup{req, n.leaf, ""}
			}},
			{"R13.3 TPM-AK statement without key_attestation", join.ReasonKeyAttestationMissing, true, func(t *testing.T, r *renewEnv) setup {
				n := r.join(t, f.acme, nil)
				stored := r.storeCert(t, n, pki.RoleNode, []string{"urn:bc:tpm-ak:sha256:0a0b"}, "[]", time.Hour)
				req, _ := jointest.RenewRequest(t, n.key, [][]byte{stored.DER, e.Bundle.NodeCA.Raw}, n.id, r.clk.Now())
				return setup{req, stored.DER, n.id}
			}},
			{"R13.3 TPM-AK statement with an unverifiable key_attestation", tpmverify.ReasonKeyAttestationInvalid, true, func(t *testing.T, r *renewEnv) setup {
				n := r.join(t, f.acme, nil)
				stored := r.storeCert(t, n, pki.RoleNode, []string{"urn:bc:tpm-ak:sha256:0a0b"}, "[]", time.Hour)
				req, _ := jointest.RenewRequest(t, n.key, [][]byte{stored.DER, e.Bundle.NodeCA.Raw}, n.id, r.clk.Now())
				req.KeyAttestation = []byte("certify")
				return setup{req, stored.DER, n.id}
			}},
		}
		for _, tc := range cases {
			t.Run(tc.name, func(t *testing.T) {
				r := newRenewEnv(t, f)
				s := tc.do(t, r)
				want, other := f.root, f.acme
				if tc.owner {
					want, other = f.acme, f.root
				}
				before := map[string]int{f.root: len(jointest.RenewRefusals(t, e.DB, f.root)), f.acme: len(jointest.RenewRefusals(t, e.DB, f.acme))}
				var certsBefore int
				if s.node != "" {
					certsBefore = len(f.certs(t, s.node))
				}
				renewedBefore := len(f.events(t, f.acme, "node.certificate-renewed"))

				_, err := r.renew(s.req, s.peer)
				jointest.WantRenewRefused(t, err)

				got := jointest.RenewRefusals(t, e.DB, want)[before[want]:]
				if len(got) != 1 || got[0].Reason != tc.reason || len(got[0].CSRSHA256) != 64 {
					t.Fatalf("tenant %s refusal events %+v, want one with reason %s and a csrSha256", want, got, tc.reason)
				}
				if s.node != "" && got[0].NodeID != s.node {
					t.Errorf("refusal nodeId %q, want %q", got[0].NodeID, s.node)
				}
				if s.node == "" && got[0].NodeID != "" {
					t.Errorf("refusal names node %q before the leaf matched a stored row", got[0].NodeID)
				}
				if extra := jointest.RenewRefusals(t, e.DB, other)[before[other]:]; len(extra) != 0 {
					t.Errorf("tenant %s got refusal events %+v, want none", other, extra)
				}
				// Nothing written: no certificate, no renewal event.
				if s.node != "" {
					if n := len(f.certs(t, s.node)); n != certsBefore {
						t.Errorf("%d node_certs rows after the refusal, want %d", n, certsBefore)
					}
				}
				if n := len(f.events(t, f.acme, "node.certificate-renewed")); n != renewedBefore {
					t.Errorf("%d renewal events after the refusal, want %d", n, renewedBefore)
				}
			})
		}
	})
}

// R13.2: a refused renewal records no proof, so the same request is not a
// replay once the cause is gone; and a proof is remembered no longer than
// its window.
func TestRenewProofWindowR13_2(t *testing.T) {
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		f := newFixture(t, e)
		r := newRenewEnv(t, f)
		n := r.join(t, f.acme, nil)
		req, next := r.request(t, n)
		if _, err := r.renew(req, nil); err == nil {
			t.Fatal("renewed without an mTLS identity")
		}
		res, err := r.renew(req, n.leaf)
		if err != nil {
			t.Fatalf("renew after a refusal with the same proof: %v", err)
		}
		next.VerifyRenewal(t, e.Bundle, res, pki.RoleNode)

		// Past the window the proof's record expired; the request is refused all
		// the same, its leaf being superseded by the renewal it made.
		r.clk.Advance(join.RenewProofWindow + time.Second)
		_, err = r.renew(req, n.leaf)
		jointest.WantRenewRefused(t, err)
		if got := jointest.RenewRefusals(t, e.DB, f.acme); len(got) == 0 || got[len(got)-1].Reason != "cert-superseded" {
			t.Errorf("refusals %+v, want the last cert-superseded", got)
		}
	})
}

// R13.5: refusal events are rate-limited per reason, like join refusals.
func TestRenewRefusalsRateLimitedR13_5(t *testing.T) {
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		f := newFixture(t, e)
		clk := clock.NewFake(time.Now())
		svc := ownService(t, e, clk, events.NewLimiter(clk, 2, time.Minute), 0)
		for range 5 {
			_, err := svc.Renew(context.Background(), &agentv1.RenewRequest{Csr: []byte("x")}, join.Peer{})
			jointest.WantRenewRefused(t, err)
		}
		if got := jointest.RenewRefusals(t, e.DB, f.root); len(got) != 2 {
			t.Fatalf("%d refusal events, want 2", len(got))
		}
		clk.Advance(time.Minute)
		_, err := svc.Renew(context.Background(), &agentv1.RenewRequest{Csr: []byte("x")}, join.Peer{})
		jointest.WantRenewRefused(t, err)
		got := jointest.RenewRefusals(t, e.DB, f.root)
		if len(got) != 3 || got[2].Suppressed != 3 {
			t.Fatalf("refusals %+v, want a third reporting 3 suppressed", got)
		}
	})
}

// R4.8 for renewals: without the machine PKI Renew is INVALID_CONFIG.
func TestRenewNotConfigured(t *testing.T) {
	apitest.Each(t, apitest.Options{NoJoin: true}, func(t *testing.T, e *apitest.Env) {
		_, err := e.Server.Join().Renew(context.Background(), &agentv1.RenewRequest{}, join.Peer{})
		if errs.CodeOf(err) != errs.InvalidConfig {
			t.Fatalf("got %v, want INVALID_CONFIG", err)
		}
	})
}

func (r *renewEnv) write(t testing.TB, fn func(tx *store.Tx) error) {
	t.Helper()
	if err := r.f.e.DB.WithTx(context.Background(), fn); err != nil {
		t.Fatal(err)
	}
}

func mustParse(t testing.TB, der []byte) *x509.Certificate {
	t.Helper()
	c, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// R13.2: a renewal supersedes its parent. The parent renews
// nothing more, but still serves as the caller's mTLS identity for
// nodeident.SessionOverlap, so a session held on it is not cut while bcd
// moves to the new certificate; after the overlap it is refused there too.
func TestRenewSupersedesParentR13_2(t *testing.T) {
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		f := newFixture(t, e)
		r := newRenewEnv(t, f)
		n1 := r.join(t, f.acme, nil)
		renew := func(n *renewNode, peer []byte) (*renewNode, error) {
			req, next := r.request(t, n)
			res, err := r.renew(req, peer)
			if err != nil {
				return nil, err
			}
			got := next.VerifyAt(t, e.Bundle, &agentv1.JoinResponse{Body: res.GetBody(), Sig: res.GetSig(), SigningCertificate: res.GetSigningCertificate()},
				pki.RoleNode, r.clk.Now())
			return &renewNode{id: n.id, key: next.Key, chain: got.Body.CertChain, leaf: got.Leaf.Raw}, nil
		}
		n2, err := renew(n1, n1.leaf)
		if err != nil {
			t.Fatal(err)
		}
		for _, c := range f.certs(t, n1.id) {
			if bytes.Equal(c.DER, n1.leaf) && c.SupersededAt == nil {
				t.Error("the parent is not marked superseded")
			}
			if bytes.Equal(c.DER, n2.leaf) && c.SupersededAt != nil {
				t.Error("the new certificate is marked superseded")
			}
		}
		// Within the overlap the superseded parent is still the caller's
		// mTLS identity.
		r.clk.Advance(nodeident.SessionOverlap - time.Second)
		n3, err := renew(n2, n1.leaf)
		if err != nil {
			t.Fatalf("renew with the parent as mTLS identity inside the overlap: %v", err)
		}
		// Past the overlap, n2 (superseded a moment ago by n3) still
		// serves, n1 no longer does.
		r.clk.Advance(2 * time.Second)
		req, _ := r.request(t, n3)
		_, err = r.renew(req, n1.leaf)
		jointest.WantRenewRefused(t, err)
		if got := jointest.RenewRefusals(t, e.DB, f.acme); len(got) == 0 || got[len(got)-1].Reason != "peer-superseded" {
			t.Errorf("refusals %+v, want the last peer-superseded", got)
		}
		if _, err := renew(n3, n2.leaf); err != nil {
			t.Fatalf("renew with n2 inside its overlap: %v", err)
		}
	})
}

// R21.1: a renewal sent again from the certificate it superseded, with the
// same CSR (its answer was lost, or the daemon could not accept it yet),
// gets the same certificate answered anew and nothing is issued. Another
// CSR from the superseded certificate, and the same CSR once the new
// certificate renewed in turn, are refused (cert-superseded).
func TestRenewSameCSRAnsweredAgainR21_1(t *testing.T) {
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		f := newFixture(t, e)
		r := newRenewEnv(t, f)
		n1 := r.join(t, f.acme, nil)
		req, next := r.request(t, n1)
		first, err := r.renew(req, n1.leaf)
		if err != nil {
			t.Fatal(err)
		}
		got1 := next.VerifyRenewal(t, e.Bundle, first, pki.RoleNode)
		again := func(csr []byte) (*agentv1.RenewResponse, error) {
			r.clk.Advance(time.Second)
			ms := r.clk.Now().UnixMilli()
			sig, err := pki.SignRenewPoP(n1.key, csr, n1.id, ms)
			if err != nil {
				t.Fatal(err)
			}
			return r.renew(&agentv1.RenewRequest{Csr: csr, Chain: n1.chain, ClientTimeUnixMs: ms, PopSig: sig, NodeId: n1.id}, n1.leaf)
		}
		res, err := again(req.GetCsr())
		if err != nil {
			t.Fatalf("the same CSR from the superseded certificate: %v", err)
		}
		got2 := next.VerifyRenewal(t, e.Bundle, res, pki.RoleNode)
		if !bytes.Equal(got2.Leaf.Raw, got1.Leaf.Raw) {
			t.Error("the same CSR was answered with another certificate")
		}
		if n := len(f.certs(t, n1.id)); n != 2 {
			t.Errorf("%d certificates, want 2: answering again issues nothing", n)
		}

		other, _ := jointest.RenewRequest(t, n1.key, n1.chain, n1.id, r.clk.Now())
		_, err = again(other.GetCsr())
		jointest.WantRenewRefused(t, err)

		// The new certificate renews: the first CSR is no longer answered.
		n2 := &renewNode{id: n1.id, key: next.Key, chain: got1.Body.CertChain, leaf: got1.Leaf.Raw}
		req3, _ := r.request(t, n2)
		if _, err := r.renew(req3, n2.leaf); err != nil {
			t.Fatal(err)
		}
		_, err = again(req.GetCsr())
		jointest.WantRenewRefused(t, err)
		if got := jointest.RenewRefusals(t, e.DB, f.acme); len(got) == 0 || got[len(got)-1].Reason != "cert-superseded" {
			t.Errorf("refusals %+v, want the last cert-superseded", got)
		}
	})
}
