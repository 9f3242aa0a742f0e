package join_test

import (
	"context"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
	"github.com/better-compute/better-compute/internal/client"
	"github.com/better-compute/better-compute/internal/controlplane/apitest"
	"github.com/better-compute/better-compute/internal/controlplane/events"
	"github.com/better-compute/better-compute/internal/controlplane/join"
	"github.com/better-compute/better-compute/internal/controlplane/join/jointest"
	"github.com/better-compute/better-compute/internal/shared/clock"
	"github.com/better-compute/better-compute/internal/shared/pki"
)

// tenantEnv is a third tenant of a fixture with its own admin, site and
// pool.
type tenantEnv struct {
	id    string
	admin *client.Client
	pool  *bcv1.Pool
}

func (f *fixture) tenant(t testing.TB, name string) *tenantEnv {
	t.Helper()
	ctx := context.Background()
	tn, err := f.e.Admin.Tenants.CreateTenant(ctx, rq(&bcv1.CreateTenantRequest{Name: name}))
	if err != nil {
		t.Fatal(err)
	}
	k, err := f.e.Admin.APIKeys.CreateApiKey(ctx, rq(&bcv1.CreateApiKeyRequest{TenantId: tn.Msg.Id, Name: name + "-admin",
		Grants: []*bcv1.Grant{{Action: "*", Resource: "*"}}}))
	if err != nil {
		t.Fatal(err)
	}
	admin := f.e.Client(t, k.Msg.Key)
	site := mkSite(t, admin, tn.Msg.Id, name+"-dc")
	return &tenantEnv{id: tn.Msg.Id, admin: admin, pool: mkPool(t, admin, tn.Msg.Id, site.Id, name+"-pool", nil)}
}

// R6.3: hardware keys are matched within a tenant. A machine that
// tenant acme registered first (claims are self-reported: acme may only
// know its serial and UUID) still joins globex, as globex's own node; the
// collision is recorded for the root tenant only, and neither tenant
// learns of the other.
func TestHardwareKeyPerTenantR6_3(t *testing.T) {
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		f := newFixture(t, e)
		globex := f.tenant(t, "globex")
		claims := jointest.Claims(70001)

		acmeTok := f.token(t, &bcv1.CreateJoinTokenRequest{TenantId: f.acme, PoolId: f.acmePool.Id})
		first := f.mustJoin(t, jointest.NewMachine(t, claims), acmeTok.Token, pki.RoleNode)

		gTok := f.token(t, &bcv1.CreateJoinTokenRequest{TenantId: globex.id, PoolId: globex.pool.Id})
		second := f.mustJoin(t, jointest.NewMachine(t, claims), gTok.Token, pki.RoleNode)
		if second.Body.NodeId == first.Body.NodeId {
			t.Fatalf("globex's join landed on acme's node %s", first.Body.NodeId)
		}
		if n := f.node(t, second.Body.NodeId); n.TenantID != globex.id || !n.HardwareKeyTrusted || n.IdentityGeneration != 1 {
			t.Errorf("globex's node %+v: want globex's, trusted, generation 1", n)
		}
		if n := f.node(t, first.Body.NodeId); n.IdentityGeneration != 1 {
			t.Errorf("acme's node moved to generation %d", n.IdentityGeneration)
		}
		conflicts := f.events(t, f.root, "security.hardware-key.conflict")
		if len(conflicts) != 1 || conflicts[0].Data["nodeId"] != second.Body.NodeId || conflicts[0].Data["tenantId"] != globex.id {
			t.Fatalf("root's conflict events %+v, want one for globex's node", conflicts)
		}
		if others, _ := conflicts[0].Data["others"].([]any); len(others) != 1 {
			t.Errorf("conflict names %v, want acme's node", conflicts[0].Data["others"])
		}
		for _, tn := range []string{f.acme, globex.id} {
			for _, prefix := range []string{"security.hardware-key.", "security.join.refused"} {
				if got := f.events(t, tn, prefix); len(got) != 0 {
					t.Errorf("tenant %s sees %s events %+v, want none", tn, prefix, got)
				}
			}
		}
		// Each tenant still reclaims its own node, and only its own.
		reTok := f.token(t, &bcv1.CreateJoinTokenRequest{TenantId: f.acme, PoolId: f.acmePool.Id, AllowReclaim: true})
		re := f.mustJoin(t, jointest.NewMachine(t, claims), reTok.Token, pki.RoleNode)
		if re.Body.NodeId != first.Body.NodeId {
			t.Errorf("acme's reclaim gave %s, want its node %s", re.Body.NodeId, first.Body.NodeId)
		}
		if n := f.node(t, second.Body.NodeId); n.IdentityGeneration != 1 {
			t.Errorf("acme's reclaim moved globex's node to generation %d", n.IdentityGeneration)
		}
	})
}

// R4.7: the refusal limiter is keyed by tenant: 70 refusals of
// acme leave globex's 5 all recorded, unsuppressed, and acme's next event
// counts only acme's dropped ones.
func TestRefusalLimiterPerTenantR4_7(t *testing.T) {
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		f := newFixture(t, e)
		globex := f.tenant(t, "globex")
		clk := clock.NewFake(time.Now())
		svc := ownService(t, e, clk, events.NewLimiter(clk, 60, time.Minute), 0)
		// An expect binding that never matches: refused after the token's
		// secret verified, so to the token's tenant.
		refuse := func(tenant, pool string, n int) {
			tok := f.token(t, &bcv1.CreateJoinTokenRequest{TenantId: tenant, PoolId: pool, MaxUses: 1, Expect: &bcv1.Expect{Serial: "SN-NEVER"}})
			for i := range n {
				m := jointest.NewMachine(t, jointest.Claims(71000+i))
				_, err := svc.Join(context.Background(), m.RequestAt(t, e.Bundle, tok.Token, "", clk.Now()), join.Peer{})
				jointest.WantRefused(t, err)
			}
		}
		refuse(f.acme, f.acmePool.Id, 70)
		refuse(globex.id, globex.pool.Id, 5)
		if got := jointest.Refusals(t, e.DB, f.acme); len(got) != 60 {
			t.Errorf("acme has %d refusal events, want 60", len(got))
		}
		g := jointest.Refusals(t, e.DB, globex.id)
		if len(g) != 5 {
			t.Fatalf("globex has %d refusal events, want 5: acme's refusals suppressed globex's", len(g))
		}
		for _, r := range g {
			if r.Suppressed != 0 || r.Reason != reason("expect-mismatch") {
				t.Errorf("globex refusal %+v, want expect-mismatch with nothing suppressed", r)
			}
		}
		clk.Advance(time.Minute)
		refuse(f.acme, f.acmePool.Id, 1)
		refuse(globex.id, globex.pool.Id, 1)
		if got := jointest.Refusals(t, e.DB, f.acme); got[len(got)-1].Suppressed != 10 {
			t.Errorf("acme's next event suppressed %d, want acme's own 10", got[len(got)-1].Suppressed)
		}
		if got := jointest.Refusals(t, e.DB, globex.id); got[len(got)-1].Suppressed != 0 {
			t.Errorf("globex's next event suppressed %d, want 0", got[len(got)-1].Suppressed)
		}
	})
}

// R4.9: a join request that arrives again gets the answer stored
// for it and changes nothing: the answer is byte for byte the same, one
// node, one use spent, no generation moved, even with a multi-use
// allowReclaim token (the replay that used to reclaim the node). A request
// resealed later (bcd retrying after a lost answer) gets it too.
func TestJoinReplayGetsStoredAnswerR4_9(t *testing.T) {
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		f := newFixture(t, e)
		tok := f.token(t, &bcv1.CreateJoinTokenRequest{TenantId: f.acme, PoolId: f.acmePool.Id, MaxUses: 5, AllowReclaim: true})
		m := jointest.NewMachine(t, jointest.Claims(73001))
		req := m.Request(t, e.Bundle, tok.Token, "")
		first, err := f.svc.Join(context.Background(), req, join.Peer{})
		if err != nil {
			t.Fatal(err)
		}
		got := m.Verify(t, e.Bundle, first, pki.RoleNode)
		for i := range 3 {
			again := proto.Clone(req).(*agentv1.JoinRequest)
			if i == 2 {
				// bcd reseals the very same request when it retries.
				again.SealedToken = jointest.Seal(t, e.Bundle, tok.Token, again)
			}
			res, err := f.svc.Join(context.Background(), again, join.Peer{})
			if err != nil {
				t.Fatalf("replay %d: %v", i, err)
			}
			if !proto.Equal(res, first) {
				t.Fatalf("replay %d got another answer", i)
			}
		}
		n := f.node(t, got.Body.NodeId)
		if n.IdentityGeneration != 1 {
			t.Errorf("generation %d after replays, want 1", n.IdentityGeneration)
		}
		if u := f.usesLeft(t, tok.Id); u != 4 {
			t.Errorf("usesLeft %d, want 4", u)
		}
		if certs := f.certs(t, n.ID); len(certs) != 1 || certs[0].RevokedAt != nil {
			t.Errorf("certificates %+v, want the one, unrevoked", certs)
		}
		if j := f.events(t, f.acme, "node.joined"); len(j) != 1 {
			t.Errorf("%d node.joined events, want 1", len(j))
		}
	})
}

// R4.9 and R4.8: the answer to a join whose caller timed out after
// the commit is not lost: the retry of the same request gets the
// certificate instead of being refused as a reclaim.
func TestJoinAnswerLostAfterCommitR4_9(t *testing.T) {
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		f := newFixture(t, e)
		tok := f.token(t, &bcv1.CreateJoinTokenRequest{TenantId: f.acme, PoolId: f.acmePool.Id})
		m := jointest.NewMachine(t, jointest.Claims(74001))
		req := m.Request(t, e.Bundle, tok.Token, "")
		ctx, cancel := context.WithCancel(context.Background())
		svc := ownServiceWith(t, e, func(c *join.Config) {
			// The caller gives up the moment the transaction committed:
			// the answer never reaches the machine.
			c.AfterCommit = cancel
		})
		_, _ = svc.Join(ctx, req, join.Peer{})
		if u := f.usesLeft(t, tok.Id); u != 0 {
			t.Fatalf("usesLeft %d: the first join did not commit", u)
		}
		res, err := f.svc.Join(context.Background(), req, join.Peer{})
		if err != nil {
			t.Fatalf("retry after the lost answer: %v", err)
		}
		j := m.Verify(t, e.Bundle, res, pki.RoleNode)
		if all := f.nodes(t, f.acme); len(all) != 1 || all[0].ID != j.Body.NodeId {
			t.Errorf("nodes %+v, want the one the retry names", all)
		}
		if r := jointest.Refusals(t, e.DB, f.acme); len(r) != 0 {
			t.Errorf("refusals %+v, want none", r)
		}
	})
}

// R6.3: a reclaim needs a key never issued to the node. The
// machine's current key, in a new request (so no stored answer), is
// refused and spends nothing; a new key reclaims.
func TestReclaimNeedsNewKeyR6_3(t *testing.T) {
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		f := newFixture(t, e)
		claims := jointest.Claims(75001)
		m := jointest.NewMachine(t, claims)
		j := f.mustJoin(t, m, f.token(t, &bcv1.CreateJoinTokenRequest{TenantId: f.acme, PoolId: f.acmePool.Id}).Token, pki.RoleNode)
		tok := f.token(t, &bcv1.CreateJoinTokenRequest{TenantId: f.acme, PoolId: f.acmePool.Id, AllowReclaim: true, MaxUses: 2})
		m.Claims.Hostname = "another request"
		f.refusedOnce(t, f.acme, reason("reclaim-key-reused"), func() error { _, err := f.join(t, m, tok.Token, ""); return err })
		if u := f.usesLeft(t, tok.Id); u != 2 {
			t.Errorf("usesLeft %d, want 2", u)
		}
		re := f.mustJoin(t, jointest.NewMachine(t, claims), tok.Token, pki.RoleNode)
		if re.Body.NodeId != j.Body.NodeId || f.node(t, j.Body.NodeId).IdentityGeneration != 2 {
			t.Errorf("reclaim with a new key: node %s, want %s at generation 2", re.Body.NodeId, j.Body.NodeId)
		}
	})
}

// ownServiceWith builds a JoinService on e's store and PKI, with mod
// applied to its config.
func ownServiceWith(t testing.TB, e *apitest.Env, mod func(*join.Config)) *join.Service {
	t.Helper()
	return ownServiceConfig(t, e, clock.Real{}, nil, 0, mod)
}
