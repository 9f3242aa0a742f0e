package join_test

import (
	"bytes"
	"context"
	"crypto/x509"
	"encoding/asn1"
	"strings"
	"testing"
	"time"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
	"github.com/better-compute/better-compute/internal/controlplane/apitest"
	"github.com/better-compute/better-compute/internal/controlplane/ca"
	"github.com/better-compute/better-compute/internal/controlplane/join"
	"github.com/better-compute/better-compute/internal/controlplane/join/jointest"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/ids"
	"github.com/better-compute/better-compute/internal/shared/pki"
)

// R4.4, R4.5, R7.4, R14: a successful join writes the node (generation 1),
// its projection row, its node_certs row, the node.joined event and audit
// row; in a pool without acceptance checks the node is adopted in the same
// transaction (node.adopted after node.joined), in a pool with them it
// stays adopting. Neither queues work.
func TestJoinAdmitsR4_4(t *testing.T) {
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		f := newFixture(t, e)
		accept := mkPool(t, e.Admin, f.root, f.site.Id, "accept", &bcv1.PoolPolicy{Acceptance: &bcv1.AcceptancePolicy{MinCpus: 4}})
		for _, tc := range []struct {
			name      string
			pool      *bcv1.Pool
			wantState string
		}{
			{"pool without acceptance checks adopts", f.pool, store.NodeAdopted},
			{"pool with acceptance checks stays adopting", accept, store.NodeAdopting},
		} {
			t.Run(tc.name, func(t *testing.T) {
				f.queued(t) // drain
				tok := f.token(t, &bcv1.CreateJoinTokenRequest{TenantId: f.root, PoolId: tc.pool.Id, MaxUses: 3})
				m := jointest.NewMachine(t, jointest.Claims(int(time.Now().UnixNano()%1e6)))
				j := f.mustJoin(t, m, tok.Token, pki.RoleNode)
				if j.Body.SiteId != f.site.Id {
					t.Errorf("site %s, want %s", j.Body.SiteId, f.site.Id)
				}
				n := f.node(t, j.Body.NodeId)
				if n.State != tc.wantState || n.IdentityGeneration != 1 || n.TenantID != f.root || n.PoolID != tc.pool.Id ||
					n.SiteID != f.site.Id || n.Role != pki.RoleNode || !n.HardwareKeyTrusted || n.NodeKey != "unattested" ||
					n.Attestor != "join-token" || n.JoinTokenID != tok.Id || n.Hostname != m.Claims.Hostname {
					t.Errorf("node row %+v", n)
				}
				if got := f.usesLeft(t, tok.Id); got != 2 {
					t.Errorf("usesLeft %d after one join of 3, want 2", got)
				}
				// R1.3: the authorization projection row, written in the
				// join transaction.
				var az store.NodeAuthz
				f.read(t, func(tx *store.Tx) (err error) { az, err = tx.GetNodeAuthz(context.Background(), n.ID); return })
				if az != (store.NodeAuthz{NodeID: n.ID, TenantID: f.root, SiteID: f.site.Id, PoolID: tc.pool.Id, Role: pki.RoleNode}) {
					t.Errorf("node_authz %+v", az)
				}
				certs := f.certs(t, n.ID)
				if len(certs) != 1 || !bytes.Equal(certs[0].DER, j.Leaf.Raw) || certs[0].Serial != pki.SerialHex(j.Leaf) ||
					certs[0].IdentityGeneration != 1 || !bytes.Equal(certs[0].SPKISHA256, pki.SPKIHash(j.Leaf)) || certs[0].RevokedAt != nil {
					t.Fatalf("node_certs %+v, want one row with the issued leaf", certs)
				}
				evs := f.events(t, f.root, "node.joined")
				var ev *event
				for i := range evs {
					if evs[i].Subject == n.ID {
						ev = &evs[i]
					}
				}
				if ev == nil {
					t.Fatal("no node.joined event")
				}
				rows := f.audit(t, f.root, "node.joined")
				var ad *auditRow
				for i := range rows {
					if rows[i].Resource == "compute-node/"+n.ID {
						ad = &rows[i]
					}
				}
				if ad == nil {
					t.Fatal("no node.joined audit row")
				}
				for what, d := range map[string]map[string]any{"event": ev.Data, "audit": ad.Data} {
					if d["attestor"] != "join-token" || d["reclaim"] != false || d["hardwareKeyTrusted"] != true ||
						d["certSerial"] != certs[0].Serial || d["nodeKey"] != "unattested" || d["nodeId"] != n.ID {
						t.Errorf("%s data %v", what, d)
					}
				}
				if q := f.queued(t); contains(q, n.ID) {
					t.Errorf("node queued (queue %v), want no work", q)
				}
				adopted := len(f.audit(t, f.root, "node.adopted")) > 0 && contains(subjects(f.events(t, f.root, "node.adopted")), n.ID)
				if adopted != (tc.wantState == store.NodeAdopted) {
					t.Errorf("node.adopted written %v, want %v", adopted, tc.wantState == store.NodeAdopted)
				}
			})
		}
	})
}

// R4.2, R4.4, R4.7: every refusal answers ACCESS_DENIED "Join refused"; the
// reason goes to the root tenant until the token's secret verified, to the
// token's tenant after.
func TestJoinRefusalsR4_4(t *testing.T) {
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		f := newFixture(t, e)
		ctx := context.Background()
		acmeTok := func(r *bcv1.CreateJoinTokenRequest) *bcv1.JoinToken {
			if r == nil {
				r = &bcv1.CreateJoinTokenRequest{}
			}
			r.TenantId, r.PoolId = f.acme, f.acmePool.Id
			return f.token(t, r)
		}
		n := 0
		machine := func() *jointest.Machine { n++; return jointest.NewMachine(t, jointest.Claims(1000+n)) }
		joinReq := func(req *agentv1.JoinRequest) error {
			_, err := f.svc.Join(ctx, req, join.Peer{})
			return err
		}
		joinWith := func(token, role string) func() error {
			return func() error { _, err := f.join(t, machine(), token, role); return err }
		}

		for _, tc := range []struct {
			name   string
			tenant string // "root" or "acme"
			reason string
			do     func(t *testing.T) func() error
		}{
			{"R4.2 seal made for another CSR", "root", "seal-csr-mismatch", func(t *testing.T) func() error {
				tok := acmeTok(nil)
				m, other := machine(), machine()
				req := m.Request(t, e.Bundle, "", "")
				req.SealedToken = jointest.Seal(t, e.Bundle, tok.Token, other.Request(t, nil, "", ""))
				return func() error { return joinReq(req) }
			}},
			{"R4.2 malformed JWE", "root", "seal-malformed", func(t *testing.T) func() error {
				req := machine().Request(t, e.Bundle, "", "")
				req.SealedToken = "eyJhbGciOiJFQ0RILUVTK0EyNTZLVyJ9.not.a.jwe"
				return func() error { return joinReq(req) }
			}},
			{"R4.2 sealed to another key", "root", "seal-decrypt", func(t *testing.T) func() error {
				tok := acmeTok(nil)
				other, err := ca.Generate("other.example.com", time.Now())
				if err != nil {
					t.Fatal(err)
				}
				m := machine()
				req := m.Request(t, e.Bundle, "", "")
				req.SealedToken = jointest.Seal(t, other, tok.Token, req)
				return func() error { return joinReq(req) }
			}},
			{"no token", "root", "token-missing", func(t *testing.T) func() error { return joinWith("", "") }},
			{"not a token", "root", "token-malformed", func(t *testing.T) func() error { return joinWith("hello", "") }},
			{"unknown token id", "root", "token-unknown", func(t *testing.T) func() error {
				tok := acmeTok(nil)
				_, secret, _ := strings.Cut(tok.Token, ".")
				return joinWith("bcjt_"+ids.New(ids.JoinToken, time.Now())+"."+secret, "")
			}},
			{"wrong secret", "root", "token-secret", func(t *testing.T) func() error {
				tok := acmeTok(nil)
				other := acmeTok(nil)
				id, _, _ := strings.Cut(tok.Token, ".")
				_, secret, _ := strings.Cut(other.Token, ".")
				return joinWith(id+"."+secret, "")
			}},
			{"revoked", "acme", "token-revoked", func(t *testing.T) func() error {
				tok := acmeTok(nil)
				if _, err := f.acmeAdmin.JoinTokens.RevokeJoinToken(ctx, rq(&bcv1.RevokeJoinTokenRequest{TenantId: f.acme, PoolId: f.acmePool.Id, TokenId: tok.Id})); err != nil {
					t.Fatal(err)
				}
				return joinWith(tok.Token, "")
			}},
			{"used up", "acme", "token-used-up", func(t *testing.T) func() error {
				tok := acmeTok(&bcv1.CreateJoinTokenRequest{MaxUses: 1})
				f.mustJoin(t, machine(), tok.Token, "")
				return joinWith(tok.Token, "")
			}},
			{"expired at the database's clock", "acme", "token-expired", func(t *testing.T) func() error {
				tok := acmeTok(&bcv1.CreateJoinTokenRequest{TtlSeconds: 60})
				return func() error {
					if err := e.DB.SetClockOffset(ctx, 2*time.Minute); err != nil {
						t.Fatal(err)
					}
					defer e.DB.SetClockOffset(ctx, 0)
					return joinWith(tok.Token, "")()
				}
			}},
			// R2.7: a token presented for another role is refused.
			{"wrong role", "acme", "token-role", func(t *testing.T) func() error {
				return joinWith(acmeTok(nil).Token, pki.RoleSite)
			}},
			{"R5.1 expect mismatch", "acme", "expect-mismatch", func(t *testing.T) func() error {
				return joinWith(acmeTok(&bcv1.CreateJoinTokenRequest{Expect: &bcv1.Expect{Serial: "SN-OTHER"}}).Token, "")
			}},
			{"role the daemon may not ask for", "root", "role-invalid", func(t *testing.T) func() error {
				return joinWith(acmeTok(nil).Token, pki.RoleNodeTenant)
			}},
			{"unknown attestor, filed under one name", "root", "attestor-unknown", func(t *testing.T) func() error {
				req := machine().Request(t, e.Bundle, acmeTok(nil).Token, "")
				req.Attestor = "magic-" + strings.Repeat("x", 1000)
				return func() error { return joinReq(req) }
			}},
		} {
			t.Run(tc.name, func(t *testing.T) {
				do := tc.do(t)
				tenant := f.root
				if tc.tenant == "acme" {
					tenant = f.acme
				}
				want := reason(tc.reason)
				if tc.reason == "attestor-unknown" {
					want = join.UnknownAttestor + ":" + tc.reason
				}
				f.refusedOnce(t, tenant, want, do)
			})
		}
		if got := f.nodes(t, f.acme); len(got) != 1 { // the "used up" case's first join
			t.Errorf("acme has %d nodes, want 1", len(got))
		}
	})
}

// R4.4, R5.1: a refused join rolls everything back: no use spent, no node.
func TestRefusedJoinSpendsNoUseR4_4(t *testing.T) {
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		f := newFixture(t, e)
		m := jointest.NewMachine(t, jointest.Claims(1))
		tok := f.token(t, &bcv1.CreateJoinTokenRequest{MaxUses: 2, Expect: &bcv1.Expect{Serial: m.Claims.ProductSerial}})
		other := jointest.NewMachine(t, jointest.Claims(2))
		for range 3 {
			f.refusedOnce(t, f.root, reason("expect-mismatch"), func() error { _, err := f.join(t, other, tok.Token, ""); return err })
		}
		if got := f.usesLeft(t, tok.Id); got != 2 {
			t.Fatalf("usesLeft %d after refused joins, want 2", got)
		}
		if got := f.nodes(t, f.root); len(got) != 0 {
			t.Fatalf("refused joins left %d nodes", len(got))
		}
		f.mustJoin(t, m, tok.Token, pki.RoleNode)
		if got := f.usesLeft(t, tok.Id); got != 1 {
			t.Fatalf("usesLeft %d after a join, want 1", got)
		}
	})
}

// R5.2: expect compares normalized identifiers.
func TestExpectNormalizationR5_2(t *testing.T) {
	base := func() *agentv1.Claims {
		return &agentv1.Claims{ProductUuid: "4c4c4544-0042-3510-8052-b7c04f4d3732", ProductSerial: "SN-7701",
			BoardSerial: "BRD-1", ChassisSerial: "CH-1", Macs: []string{"00:1b:21:aa:bb:cc", "3c:ec:ef:01:02:03"},
			GpuUuids: []string{"GPU-8F0C1D2E-aaaa-bbbb-cccc-0123456789ab"}}
	}
	with := func(mod func(c *agentv1.Claims)) *agentv1.Claims { c := base(); mod(c); return c }
	tests := []struct {
		name   string
		expect *bcv1.Expect
		claims *agentv1.Claims
		ok     bool
	}{
		{"productUuid upper case without dashes in the token", &bcv1.Expect{ProductUuid: "4C4C4544004235108052B7C04F4D3732"}, base(), true},
		{"productUuid upper case in the claims", &bcv1.Expect{ProductUuid: "4c4c4544-0042-3510-8052-b7c04f4d3732"}, with(func(c *agentv1.Claims) { c.ProductUuid = "{4C4C4544-0042-3510-8052-B7C04F4D3732}" }), true},
		{"productUuid differs", &bcv1.Expect{ProductUuid: "4c4c4544-0042-3510-8052-b7c04f4d3733"}, base(), false},
		{"placeholder productUuid in the claims never matches", &bcv1.Expect{ProductUuid: "4c4c4544-0042-3510-8052-b7c04f4d3732"},
			with(func(c *agentv1.Claims) { c.ProductUuid = "00000000-0000-0000-0000-000000000000" }), false},
		{"serial matches the product serial, case-insensitively", &bcv1.Expect{Serial: "sn-7701"}, base(), true},
		{"serial matches the board serial", &bcv1.Expect{Serial: "brd-1"}, base(), true},
		{"serial matches the chassis serial", &bcv1.Expect{Serial: "Ch-1"}, base(), true},
		{"serial matches none", &bcv1.Expect{Serial: "SN-7702"}, base(), false},
		{"mac with dashes and upper case", &bcv1.Expect{Mac: "3C-EC-EF-01-02-03"}, base(), true},
		{"mac dotted", &bcv1.Expect{Mac: "001b.21aa.bbcc"}, base(), true},
		{"mac bare in the claims", &bcv1.Expect{Mac: "00:1b:21:aa:bb:cc"}, with(func(c *agentv1.Claims) { c.Macs = []string{"001B21AABBCC"} }), true},
		{"mac not among the claims", &bcv1.Expect{Mac: "00:1b:21:aa:bb:cd"}, base(), false},
		{"locally administered mac in the claims does not bind", &bcv1.Expect{Mac: "00:1b:21:aa:bb:cc"},
			with(func(c *agentv1.Claims) { c.Macs = []string{"02:1b:21:aa:bb:cc"} }), false},
		{"gpuUuid case-insensitive", &bcv1.Expect{GpuUuid: "gpu-8f0c1d2e-AAAA-bbbb-cccc-0123456789AB"}, base(), true},
		{"gpuUuid differs", &bcv1.Expect{GpuUuid: "GPU-00000001"}, base(), false},
		{"every named field must match", &bcv1.Expect{Serial: "SN-7701", Mac: "00:1b:21:aa:bb:cd"}, base(), false},
		{"all fields", &bcv1.Expect{ProductUuid: "4C4C4544-0042-3510-8052-B7C04F4D3732", Serial: "sn-7701", Mac: "00:1B:21:AA:BB:CC",
			GpuUuid: "GPU-8F0C1D2E-AAAA-BBBB-CCCC-0123456789AB"}, base(), true},
	}
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		f := newFixture(t, e)
		for _, tc := range tests {
			t.Run(tc.name, func(t *testing.T) {
				tok := f.token(t, &bcv1.CreateJoinTokenRequest{Expect: tc.expect})
				m := jointest.NewMachine(t, tc.claims)
				if !tc.ok {
					f.refusedOnce(t, f.root, reason("expect-mismatch"), func() error { _, err := f.join(t, m, tok.Token, ""); return err })
					if got := f.usesLeft(t, tok.Id); got != 1 {
						t.Errorf("usesLeft %d after a mismatch, want 1", got)
					}
					return
				}
				j := f.mustJoin(t, m, tok.Token, pki.RoleNode)
				// Retire it so the next case's machine (same claims) is new.
				if err := e.DB.WithTx(context.Background(), func(tx *store.Tx) error {
					return tx.SetNodeState(context.Background(), j.Body.NodeId, store.NodeRetired, "test")
				}); err != nil {
					t.Fatal(err)
				}
			})
		}
		// A placeholder UUID cannot even be a binding.
		_, err := e.Admin.JoinTokens.CreateJoinToken(context.Background(), rq(&bcv1.CreateJoinTokenRequest{TenantId: f.root, PoolId: f.pool.Id, TtlSeconds: 60,
			Expect: &bcv1.Expect{ProductUuid: "FFFFFFFF-FFFF-FFFF-FFFF-FFFFFFFFFFFF"}}))
		if errs.CodeOf(err) != errs.InvalidArgument {
			t.Errorf("placeholder expect.productUuid: %v, want INVALID_ARGUMENT", err)
		}
	})
}

// R6.2: placeholder hardware is refused unless the token has an expect
// binding, which admits it with an untrusted key.
func TestPlaceholderHardwareR6_2(t *testing.T) {
	tests := []struct {
		name   string
		claims *agentv1.Claims
		expect *bcv1.Expect
	}{
		{"placeholder serial only", &agentv1.Claims{ProductSerial: "To Be Filled By O.E.M.", BoardSerial: "Default string",
			ChassisSerial: "System Serial Number", ProductUuid: "00000000-0000-0000-0000-000000000000", Macs: []string{"00:1b:21:10:20:30"}},
			&bcv1.Expect{Mac: "00:1b:21:10:20:30"}},
		{"one MAC only", &agentv1.Claims{Macs: []string{"00:1b:21:10:20:31"}}, &bcv1.Expect{Mac: "00-1B-21-10-20-31"}},
		{"one serial only (untrusted key)", &agentv1.Claims{ProductSerial: "SN-LONELY"}, &bcv1.Expect{Serial: "sn-lonely"}},
		{"two MACs, no UUID or serial", &agentv1.Claims{Macs: []string{"00:1b:21:10:20:32", "00:1b:21:10:20:33"}, GpuUuids: []string{"GPU-1234"}},
			&bcv1.Expect{GpuUuid: "gpu-1234"}},
		{"repeated characters", &agentv1.Claims{ProductSerial: "0000000000", BoardSerial: "XXXXXXXX", Macs: []string{"00:1b:21:10:20:34"}},
			&bcv1.Expect{Mac: "00:1b:21:10:20:34"}},
	}
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		f := newFixture(t, e)
		for _, tc := range tests {
			t.Run(tc.name, func(t *testing.T) {
				m := jointest.NewMachine(t, tc.claims)
				tok := f.token(t, &bcv1.CreateJoinTokenRequest{MaxUses: 5})
				f.refusedOnce(t, f.root, reason("placeholder-hardware"), func() error { _, err := f.join(t, m, tok.Token, ""); return err })
				if got := f.usesLeft(t, tok.Id); got != 5 {
					t.Errorf("usesLeft %d, want 5", got)
				}
				bound := f.token(t, &bcv1.CreateJoinTokenRequest{Expect: tc.expect})
				j := f.mustJoin(t, m, bound.Token, pki.RoleNode)
				n := f.node(t, j.Body.NodeId)
				if n.HardwareKeyTrusted || len(n.HardwareKey) != 0 {
					t.Errorf("node trusted %v key %x, want an untrusted key", n.HardwareKeyTrusted, n.HardwareKey)
				}
				if ev := f.events(t, f.root, "node.joined"); ev[len(ev)-1].Data["hardwareKeyTrusted"] != false {
					t.Errorf("node.joined %v, want hardwareKeyTrusted false", ev[len(ev)-1].Data)
				}
			})
		}
	})
}

// R6.3: a machine with a trusted key that already belongs to a node, joining
// with a new key, reclaims it only with an allowReclaim token of its pool.
func TestReclaimR6_3(t *testing.T) {
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		f := newFixture(t, e)
		pool2 := mkPool(t, e.Admin, f.root, f.site.Id, "cpu", nil)
		claims := jointest.Claims(7)
		first := f.mustJoin(t, jointest.NewMachine(t, claims), f.token(t, nil).Token, pki.RoleNode)
		id := first.Body.NodeId

		t.Run("without allowReclaim", func(t *testing.T) {
			tok := f.token(t, nil)
			f.refusedOnce(t, f.root, reason("reclaim"), func() error { _, err := f.join(t, jointest.NewMachine(t, claims), tok.Token, ""); return err })
			if got := f.usesLeft(t, tok.Id); got != 1 {
				t.Errorf("usesLeft %d, want 1", got)
			}
		})
		t.Run("allowReclaim token of another pool", func(t *testing.T) {
			tok := f.token(t, &bcv1.CreateJoinTokenRequest{TenantId: f.root, PoolId: pool2.Id, AllowReclaim: true})
			f.refusedOnce(t, f.root, reason("reclaim"), func() error { _, err := f.join(t, jointest.NewMachine(t, claims), tok.Token, ""); return err })
		})
		// hardware keys are matched within a tenant. Another
		// tenant's token admits the machine as that tenant's new node
		// (TestHardwareKeyPerTenant has the whole story).
		t.Run("allowReclaim token of another tenant", func(t *testing.T) {
			tok := f.token(t, &bcv1.CreateJoinTokenRequest{TenantId: f.acme, PoolId: f.acmePool.Id, AllowReclaim: true})
			j := f.mustJoin(t, jointest.NewMachine(t, claims), tok.Token, pki.RoleNode)
			if j.Body.NodeId == id {
				t.Fatalf("acme's join reclaimed root's node %s", id)
			}
		})
		t.Run("reclaimed", func(t *testing.T) {
			tok := f.token(t, &bcv1.CreateJoinTokenRequest{AllowReclaim: true})
			// Claims in another order, case and separators: the same machine.
			c := &agentv1.Claims{ProductUuid: strings.ToUpper(claims.ProductUuid), ProductSerial: strings.ToLower(claims.ProductSerial),
				Macs: []string{strings.ReplaceAll(strings.ToUpper(claims.Macs[0]), ":", "-")}, Hostname: "reinstalled"}
			m := jointest.NewMachine(t, c)
			f.queued(t)
			j := f.mustJoin(t, m, tok.Token, pki.RoleNode)
			if j.Body.NodeId != id {
				t.Fatalf("reclaim gave node %s, want %s", j.Body.NodeId, id)
			}
			n := f.node(t, id)
			if n.IdentityGeneration != 2 || n.State != store.NodeAdopted || n.Hostname != "reinstalled" {
				t.Errorf("node %+v: want generation 2, adopted, the new hostname", n)
			}
			if all := f.nodes(t, f.root); len(all) != 1 {
				t.Errorf("%d nodes, want 1", len(all))
			}
			certs := f.certs(t, id)
			if len(certs) != 2 {
				t.Fatalf("%d certs, want 2", len(certs))
			}
			var old, cur store.NodeCert
			for _, c := range certs {
				if c.IdentityGeneration == 1 {
					old = c
				} else {
					cur = c
				}
			}
			if old.RevokedAt == nil || old.RevokeReason != "reclaimed" || !bytes.Equal(old.DER, first.Leaf.Raw) {
				t.Errorf("old cert revoked %v reason %q", old.RevokedAt, old.RevokeReason)
			}
			if cur.RevokedAt != nil || cur.IdentityGeneration != 2 || !bytes.Equal(cur.DER, j.Leaf.Raw) {
				t.Errorf("new cert %+v", cur)
			}
			revs := f.events(t, f.root, "security.certificate-revoked")
			if len(revs) != 1 || revs[0].Data["serial"] != old.Serial || revs[0].Data["reason"] != "reclaimed" || revs[0].Data["nodeId"] != id {
				t.Errorf("certificate-revoked events %v", revs)
			}
			if rows := f.audit(t, f.root, "node.reclaimed"); len(rows) != 1 || rows[0].Data["reclaim"] != true || rows[0].Data["identityGeneration"] != float64(2) {
				t.Errorf("node.reclaimed audit rows %v", rows)
			}
			// R4.5: adopted again in the reclaim's transaction, as the
			// controller did from the queue.
			if q := f.queued(t); contains(q, id) {
				t.Errorf("reclaimed node queued: %v", q)
			}
			var gens []any
			for _, ev := range f.events(t, f.root, "node.adopted") {
				if ev.Subject == id {
					gens = append(gens, ev.Data["identityGeneration"])
				}
			}
			if len(gens) != 2 || gens[1] != float64(2) {
				t.Errorf("node.adopted events of %s for generations %v, want 1 and 2", id, gens)
			}
		})
		t.Run("fewer than two identifiers never reclaims", func(t *testing.T) {
			c := &agentv1.Claims{Macs: []string{"00:1b:21:77:77:77"}}
			tok := f.token(t, &bcv1.CreateJoinTokenRequest{MaxUses: 2, AllowReclaim: true, Expect: &bcv1.Expect{Mac: "00:1b:21:77:77:77"}})
			a := f.mustJoin(t, jointest.NewMachine(t, c), tok.Token, pki.RoleNode)
			b := f.mustJoin(t, jointest.NewMachine(t, c), tok.Token, pki.RoleNode)
			if a.Body.NodeId == b.Body.NodeId {
				t.Fatalf("an untrusted key reclaimed node %s", a.Body.NodeId)
			}
			if g := f.node(t, b.Body.NodeId).IdentityGeneration; g != 1 {
				t.Errorf("generation %d, want 1", g)
			}
		})
	})
}

// R6.4: a pool whose joinAttestors omit join-token refuses token joins and
// token reclaims.
func TestPoolAttestorR6_4(t *testing.T) {
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		f := newFixture(t, e)
		claims := jointest.Claims(3)
		f.mustJoin(t, jointest.NewMachine(t, claims), f.token(t, nil).Token, "")
		tok := f.token(t, &bcv1.CreateJoinTokenRequest{MaxUses: 2, AllowReclaim: true})
		if _, err := e.Admin.Pools.UpdatePoolPolicy(context.Background(), rq(&bcv1.UpdatePoolPolicyRequest{TenantId: f.root, PoolId: f.pool.Id,
			Policy: &bcv1.PoolPolicy{JoinAttestors: []string{"tpm"}}})); err != nil {
			t.Fatal(err)
		}
		f.refusedOnce(t, f.root, reason("pool-attestor"), func() error {
			_, err := f.join(t, jointest.NewMachine(t, jointest.Claims(4)), tok.Token, "")
			return err
		})
		f.refusedOnce(t, f.root, reason("pool-attestor"), func() error { _, err := f.join(t, jointest.NewMachine(t, claims), tok.Token, ""); return err })
		if got := f.usesLeft(t, tok.Id); got != 2 {
			t.Errorf("usesLeft %d, want 2", got)
		}
		if _, err := e.Admin.Pools.UpdatePoolPolicy(context.Background(), rq(&bcv1.UpdatePoolPolicyRequest{TenantId: f.root, PoolId: f.pool.Id,
			Policy: &bcv1.PoolPolicy{JoinAttestors: []string{"tpm", "join-token"}}})); err != nil {
			t.Fatal(err)
		}
		f.mustJoin(t, jointest.NewMachine(t, jointest.Claims(4)), tok.Token, pki.RoleNode)
	})
}

// R8, R2.8: a hosted token makes a node-tenant unless the pool is platform-operated
// and platform-owned; the token decides, and a hosted reclaim lowers a
// platform node.
func TestHostedTokensR8(t *testing.T) {
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		f := newFixture(t, e)
		operated := &bcv1.PoolPolicy{Kubernetes: &bcv1.KubernetesPolicy{PlatformOperated: true}}
		platformOp := mkPool(t, e.Admin, f.root, f.site.Id, "k8s-op", operated)
		acmeOp := mkPool(t, f.acmeAdmin, f.acme, f.acmeSite.Id, "acme-k8s", operated)
		acmeOnPlatformSite := mkPool(t, f.acmeAdmin, f.acme, f.site.Id, "acme-on-eu1", operated)
		rootSite2 := mkSite(t, e.Admin, f.root, "root-2") // root's sites are platform sites
		rootOp2 := mkPool(t, e.Admin, f.root, rootSite2.Id, "k8s-op-2", operated)
		n := 100
		for _, tc := range []struct {
			name   string
			tenant string
			pool   *bcv1.Pool
			hosted string
			want   string
		}{
			{"hosted token in a platform pool", f.root, f.pool, "kubernetes", pki.RoleNodeTenant},
			{"plain token in a platform pool", f.root, f.pool, "", pki.RoleNode},
			{"hosted token, platform-operated platform pool", f.root, platformOp, "kubernetes", pki.RoleNode},
			{"hosted token, platform-operated pool on another platform site", f.root, rootOp2, "kubernetes", pki.RoleNode},
			{"hosted token, tenant's pool claiming platformOperated", f.acme, acmeOp, "kubernetes", pki.RoleNodeTenant},
			{"hosted token, tenant's pool on a platform site claiming platformOperated", f.acme, acmeOnPlatformSite, "kubernetes", pki.RoleNodeTenant},
			{"plain token in a tenant's pool", f.acme, f.acmePool, "", pki.RoleNode},
		} {
			t.Run(tc.name, func(t *testing.T) {
				n++
				tok := f.token(t, &bcv1.CreateJoinTokenRequest{TenantId: tc.tenant, PoolId: tc.pool.Id, Hosted: tc.hosted})
				j := f.mustJoin(t, jointest.NewMachine(t, jointest.Claims(n)), tok.Token, tc.want)
				if ou := j.Leaf.Subject.OrganizationalUnit; len(ou) != 1 || ou[0] != "bc-role:"+tc.want {
					t.Errorf("leaf OU %v", ou)
				}
				if r := f.node(t, j.Body.NodeId).Role; r != tc.want {
					t.Errorf("node role %q, want %q", r, tc.want)
				}
				var az store.NodeAuthz
				f.read(t, func(tx *store.Tx) (err error) { az, err = tx.GetNodeAuthz(context.Background(), j.Body.NodeId); return })
				if az.Role != tc.want {
					t.Errorf("node_authz role %q, want %q", az.Role, tc.want)
				}
			})
		}
		t.Run("hosted reclaim lowers a platform node; a plain reclaim keeps it lowered", func(t *testing.T) {
			claims := jointest.Claims(999)
			first := f.mustJoin(t, jointest.NewMachine(t, claims), f.token(t, nil).Token, pki.RoleNode)
			hosted := f.token(t, &bcv1.CreateJoinTokenRequest{AllowReclaim: true, Hosted: "kubernetes"})
			j := f.mustJoin(t, jointest.NewMachine(t, claims), hosted.Token, pki.RoleNodeTenant)
			if j.Body.NodeId != first.Body.NodeId {
				t.Fatalf("reclaim gave %s, want %s", j.Body.NodeId, first.Body.NodeId)
			}
			var az store.NodeAuthz
			f.read(t, func(tx *store.Tx) (err error) { az, err = tx.GetNodeAuthz(context.Background(), j.Body.NodeId); return })
			if n := f.node(t, j.Body.NodeId); n.Role != pki.RoleNodeTenant || az.Role != pki.RoleNodeTenant || n.IdentityGeneration != 2 {
				t.Errorf("node role %q authz %q generation %d", n.Role, az.Role, n.IdentityGeneration)
			}
			plain := f.token(t, &bcv1.CreateJoinTokenRequest{AllowReclaim: true})
			f.mustJoin(t, jointest.NewMachine(t, claims), plain.Token, pki.RoleNodeTenant)
		})
	})
}

// R7: the certificate's name, role, key and lifetime; crypto/x509 and
// go-spiffe accept it.
func TestCertificateR7(t *testing.T) {
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		f := newFixture(t, e)
		for _, tc := range []struct {
			name string
			svc  *join.Service
			ttl  time.Duration
		}{
			{"default certTtlSeconds", f.svc, 24 * time.Hour},
			{"certTtlSeconds 3600", ownService(t, e, nil, nil, time.Hour), time.Hour},
		} {
			t.Run(tc.name, func(t *testing.T) {
				m := jointest.NewMachine(t, jointest.Claims(int(tc.ttl/time.Minute)))
				before := time.Now()
				res, err := tc.svc.Join(context.Background(), m.Request(t, e.Bundle, f.token(t, nil).Token, ""), join.Peer{})
				if err != nil {
					t.Fatal(err)
				}
				j := m.Verify(t, e.Bundle, res, pki.RoleNode)
				checkNodeCert(t, e.Bundle, j, f.site.Id, tc.ttl, before)
			})
		}
	})
}

// R4.8: JoinService without a machine PKI is INVALID_CONFIG, not a refusal.
func TestNotConfiguredR4_8(t *testing.T) {
	apitest.Each(t, apitest.Options{NoJoin: true}, func(t *testing.T, e *apitest.Env) {
		k := jointest.Key(t)
		_, err := e.Server.Join().Join(context.Background(), &agentv1.JoinRequest{SealedToken: "x", Csr: jointest.CSR(t, k)}, join.Peer{})
		if errs.CodeOf(err) != errs.InvalidConfig {
			t.Fatalf("got %v, want INVALID_CONFIG", err)
		}
		if got := jointest.Refusals(t, e.DB, e.RootTenant); len(got) != 0 {
			t.Errorf("an unconfigured JoinService recorded refusals %v", got)
		}
	})
}

func checkNodeCert(t *testing.T, b *ca.Bundle, j *jointest.Joined, site string, ttl time.Duration, before time.Time) {
	t.Helper()
	leaf := j.Leaf
	want := "spiffe://test.example.com/site/" + site + "/node/" + j.Body.NodeId
	if len(leaf.URIs) != 1 || leaf.URIs[0].String() != want {
		t.Errorf("URI SANs %v, want exactly [%s]", leaf.URIs, want)
	}
	if len(leaf.DNSNames)+len(leaf.IPAddresses)+len(leaf.EmailAddresses) != 0 {
		t.Errorf("the CSR's names leaked into the certificate: %v %v %v", leaf.DNSNames, leaf.IPAddresses, leaf.EmailAddresses)
	}
	if ou := leaf.Subject.OrganizationalUnit; len(ou) != 1 || ou[0] != "bc-role:node" {
		t.Errorf("OU %v", ou)
	}
	if leaf.PublicKeyAlgorithm != x509.ECDSA {
		t.Errorf("key algorithm %v", leaf.PublicKeyAlgorithm)
	}
	if life := leaf.NotAfter.Sub(leaf.NotBefore); life > ttl || life < ttl-time.Second {
		t.Errorf("lifetime %v, want %v", life, ttl)
	}
	if !leaf.NotBefore.Before(before) || leaf.NotAfter.After(before.Add(ttl+time.Minute)) {
		t.Errorf("validity %v..%v, joined at %v", leaf.NotBefore, leaf.NotAfter, before)
	}
	privateArc := asn1.ObjectIdentifier{1, 3, 6, 1, 4, 1}
	for _, ext := range leaf.Extensions {
		if len(ext.Id) > len(privateArc) && ext.Id[:len(privateArc)].Equal(privateArc) {
			t.Errorf("private-arc extension %v", ext.Id)
		}
	}
	if j.Identity.Statements != nil {
		t.Errorf("a token join carries statements %v", j.Identity.Statements)
	}
	checkSVID(t, leaf, want)
	checkSVIDChain(t, b.TrustDomain, b.NodeCA, j.Body.CertChain)
}
