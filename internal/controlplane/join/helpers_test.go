package join_test

import (
	"context"
	"encoding/json"
	"slices"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
	"github.com/better-compute/better-compute/internal/client"
	"github.com/better-compute/better-compute/internal/controlplane/apitest"
	"github.com/better-compute/better-compute/internal/controlplane/events"
	"github.com/better-compute/better-compute/internal/controlplane/join"
	"github.com/better-compute/better-compute/internal/controlplane/join/attest"
	"github.com/better-compute/better-compute/internal/controlplane/join/attest/jointoken"
	"github.com/better-compute/better-compute/internal/controlplane/join/jointest"
	"github.com/better-compute/better-compute/internal/controlplane/nodeident"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/shared/clock"
)

// Helpers shared by the JoinService tests. Tokens, sites and pools are made
// through the real operator API (apitest); joins go to the JoinService the
// API server built (or one built here on the same store and PKI when a test
// needs its own clock or lifetime); outcomes are read back through the
// store.

func rq[T any](m *T) *connect.Request[T] { return connect.NewRequest(m) }

// fixture is the root tenant with a platform site and a bcd pool, and a
// second tenant "acme" with its own admin, custom site and bcd pool.
type fixture struct {
	e    *apitest.Env
	svc  *join.Service
	root string
	site *bcv1.Site
	pool *bcv1.Pool

	acme      string
	acmeAdmin *client.Client
	acmeSite  *bcv1.Site
	acmePool  *bcv1.Pool
}

func newFixture(t testing.TB, e *apitest.Env) *fixture {
	t.Helper()
	f := &fixture{e: e, svc: e.Server.Join(), root: e.RootTenant}
	f.site = mkSite(t, e.Admin, e.RootTenant, "eu-1")
	f.pool = mkPool(t, e.Admin, e.RootTenant, f.site.Id, "gpu", nil)
	ctx := context.Background()
	tn, err := e.Admin.Tenants.CreateTenant(ctx, rq(&bcv1.CreateTenantRequest{Name: "acme"}))
	if err != nil {
		t.Fatal(err)
	}
	f.acme = tn.Msg.Id
	k, err := e.Admin.APIKeys.CreateApiKey(ctx, rq(&bcv1.CreateApiKeyRequest{TenantId: f.acme, Name: "acme-admin",
		Grants: []*bcv1.Grant{{Action: "*", Resource: "*"}}}))
	if err != nil {
		t.Fatal(err)
	}
	f.acmeAdmin = e.Client(t, k.Msg.Key)
	f.acmeSite = mkSite(t, f.acmeAdmin, f.acme, "acme-dc")
	f.acmePool = mkPool(t, f.acmeAdmin, f.acme, f.acmeSite.Id, "acme-gpu", nil)
	return f
}

func mkSite(t testing.TB, c *client.Client, tenant, name string) *bcv1.Site {
	t.Helper()
	s, err := c.Sites.CreateSite(context.Background(), rq(&bcv1.CreateSiteRequest{TenantId: tenant, Name: name}))
	if err != nil {
		t.Fatal(err)
	}
	return s.Msg
}

func mkPool(t testing.TB, c *client.Client, tenant, site, name string, policy *bcv1.PoolPolicy) *bcv1.Pool {
	t.Helper()
	p, err := c.Pools.CreatePool(context.Background(), rq(&bcv1.CreatePoolRequest{TenantId: tenant, SiteId: site, Name: name, Agent: "bcd", Policy: policy}))
	if err != nil {
		t.Fatal(err)
	}
	return p.Msg
}

// token mints a token through the API: in the root pool unless r names a
// tenant and pool (acme's are minted by acme's admin).
func (f *fixture) token(t testing.TB, r *bcv1.CreateJoinTokenRequest) *bcv1.JoinToken {
	t.Helper()
	if r == nil {
		r = &bcv1.CreateJoinTokenRequest{}
	}
	if r.TenantId == "" {
		r.TenantId, r.PoolId = f.root, f.pool.Id
	}
	if r.TtlSeconds == 0 {
		r.TtlSeconds = 3600
	}
	c := f.e.Admin
	if r.TenantId == f.acme {
		c = f.acmeAdmin
	}
	tok, err := c.JoinTokens.CreateJoinToken(context.Background(), rq(r))
	if err != nil {
		t.Fatalf("create token: %v", err)
	}
	if tok.Msg.Token == "" {
		t.Fatal("created token without its bearer form")
	}
	return tok.Msg
}

// join joins m with token (for role, "" is node) through f.svc.
func (f *fixture) join(t testing.TB, m *jointest.Machine, token, role string) (*agentv1.JoinResponse, error) {
	t.Helper()
	return f.svc.Join(context.Background(), m.Request(t, f.e.Bundle, token, role), join.Peer{Addr: "192.0.2.7:40000"})
}

// mustJoin joins m and verifies the answer as bcd does.
func (f *fixture) mustJoin(t testing.TB, m *jointest.Machine, token, wantRole string) *jointest.Joined {
	t.Helper()
	res, err := f.join(t, m, token, "")
	if err != nil {
		t.Fatalf("join: %v", err)
	}
	return m.Verify(t, f.e.Bundle, res, wantRole)
}

func (f *fixture) read(t testing.TB, fn func(tx *store.Tx) error) {
	t.Helper()
	if err := f.e.DB.ReadTx(context.Background(), fn); err != nil {
		t.Fatal(err)
	}
}

func (f *fixture) node(t testing.TB, id string) store.Node {
	t.Helper()
	var n store.Node
	f.read(t, func(tx *store.Tx) (err error) { n, err = tx.GetNode(context.Background(), id); return })
	return n
}

func (f *fixture) nodes(t testing.TB, tenant string) []store.Node {
	t.Helper()
	var out []store.Node
	f.read(t, func(tx *store.Tx) (err error) {
		out, err = tx.ListNodes(context.Background(), tenant, "", "", 100000)
		return
	})
	return out
}

func (f *fixture) usesLeft(t testing.TB, tokenID string) int {
	t.Helper()
	var j store.JoinToken
	f.read(t, func(tx *store.Tx) (err error) { j, err = tx.GetJoinToken(context.Background(), tokenID); return })
	return j.UsesLeft
}

func (f *fixture) certs(t testing.TB, nodeID string) []store.NodeCert {
	t.Helper()
	var out []store.NodeCert
	f.read(t, func(tx *store.Tx) (err error) { out, err = tx.ListNodeCerts(context.Background(), nodeID, 100); return })
	return out
}

type event struct {
	Type    string
	Subject string
	Data    map[string]any
}

// events reads tenant's events of types starting with prefix.
func (f *fixture) events(t testing.TB, tenant, prefix string) []event {
	t.Helper()
	var out []event
	if err := f.e.DB.WaitEventsVisible(context.Background(), tenant, 10*time.Second); err != nil {
		t.Fatal(err)
	}
	f.read(t, func(tx *store.Tx) error {
		evs, err := tx.ListEvents(context.Background(), tenant, 0, 0, prefix, 10000)
		for _, e := range evs {
			ev := event{Type: e.Type, Subject: e.Subject}
			if err := json.Unmarshal(e.Data, &ev.Data); err != nil {
				return err
			}
			out = append(out, ev)
		}
		return err
	})
	return out
}

type auditRow struct {
	Action, Resource, Actor string
	Data                    map[string]any
}

func (f *fixture) audit(t testing.TB, tenant, action string) []auditRow {
	t.Helper()
	var out []auditRow
	f.read(t, func(tx *store.Tx) error {
		rows, err := tx.ListAudit(context.Background(), tenant, 0, 10000)
		for _, a := range rows {
			if a.Action != action {
				continue
			}
			r := auditRow{Action: a.Action, Resource: a.Resource, Actor: a.Actor}
			if err := json.Unmarshal(a.Data, &r.Data); err != nil {
				return err
			}
			out = append(out, r)
		}
		return err
	})
	return out
}

// queued claims every due work item and returns the node ids of the adopt
// items (apitest runs no controller, so nothing else takes them).
func (f *fixture) queued(t testing.TB) []string {
	t.Helper()
	var ids []string
	err := f.e.DB.WithTx(context.Background(), func(tx *store.Tx) error {
		items, err := tx.ClaimWork(context.Background(), 100000, time.Hour)
		for _, w := range items {
			if w.Kind == join.WorkAdopt {
				ids = append(ids, w.NodeID)
			}
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return ids
}

// refusedOnce joins and checks the refusal: ACCESS_DENIED "Join refused" for
// the daemon, and exactly one new security.join.refused event with reason
// in wantTenant, and none in the other tenants of f.
func (f *fixture) refusedOnce(t testing.TB, wantTenant, reason string, do func() error) {
	t.Helper()
	tenants := []string{f.root, f.acme}
	before := map[string]int{}
	for _, tn := range tenants {
		before[tn] = len(jointest.Refusals(t, f.e.DB, tn))
	}
	jointest.WantRefused(t, do())
	for _, tn := range tenants {
		got := jointest.Refusals(t, f.e.DB, tn)[before[tn]:]
		if tn != wantTenant {
			if len(got) != 0 {
				t.Errorf("tenant %s got refusal events %+v, want none", tn, got)
			}
			continue
		}
		if len(got) != 1 {
			t.Fatalf("tenant %s got %d refusal events %+v, want one with reason %s", tn, len(got), got, reason)
		}
		if got[0].Reason != reason {
			t.Errorf("refusal reason %q, want %q", got[0].Reason, reason)
		}
		if !strings.HasPrefix(reason, got[0].Attestor+":") || len(got[0].CSRSHA256) != 64 {
			t.Errorf("refusal event %+v: want the attestor of %s and a csrSha256", got[0], reason)
		}
	}
}

// ownService builds a JoinService on e's store and PKI with the given
// clock, limiter and certificate lifetime.
func ownService(t testing.TB, e *apitest.Env, c clock.Clock, lim *events.Limiter, ttl time.Duration) *join.Service {
	t.Helper()
	return ownServiceConfig(t, e, c, lim, ttl, nil)
}

// ownServiceConfig is ownService with mod applied to the config.
func ownServiceConfig(t testing.TB, e *apitest.Env, c clock.Clock, lim *events.Limiter, ttl time.Duration, mod func(*join.Config)) *join.Service {
	t.Helper()
	reg, err := attest.NewRegistry(jointoken.New())
	if err != nil {
		t.Fatal(err)
	}
	core, err := nodeident.New(nodeident.Config{DB: e.DB, Bundle: e.Bundle, Clock: c, Limiter: lim, CertTTL: ttl, Hub: e.Server.Hub()})
	if err != nil {
		t.Fatal(err)
	}
	cfg := join.Config{DB: e.DB, Core: core, Attestors: reg, Clock: c, Hub: e.Server.Hub()}
	if mod != nil {
		mod(&cfg)
	}
	svc, err := join.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return svc
}

func contains(s []string, v string) bool { return slices.Contains(s, v) }

// subjects lists the subjects of evs.
func subjects(evs []event) []string {
	out := make([]string, len(evs))
	for i, e := range evs {
		out[i] = e.Subject
	}
	return out
}

func reason(r string) string { return jointoken.Name + ":" + r }
