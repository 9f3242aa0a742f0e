package api_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
	"github.com/better-compute/better-compute/internal/checks/poll"
	"github.com/better-compute/better-compute/internal/client"
	"github.com/better-compute/better-compute/internal/controlplane/apitest"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/shared/errs"
)

// Helpers shared by the operator API tests. Every call goes through the
// real in-process server and the typed client, so errors arrive as *errs.E
// recovered from the wire.

func rq[T any](m *T) *connect.Request[T] { return connect.NewRequest(m) }

// wantErr checks that err carries code and, when field is not empty, names
// field; it returns the product error for further checks of the message.
func wantErr(t testing.TB, err error, code errs.Code, field string) *errs.E {
	t.Helper()
	if err == nil {
		t.Fatalf("want %s, got success", code)
	}
	e, ok := errs.As(err)
	if !ok {
		t.Fatalf("want %s, got a non-product error %T: %v", code, err, err)
	}
	if e.Code != code {
		t.Fatalf("want %s, got %s (field %q): %s", code, e.Code, e.Field, e.Message)
	}
	if field != "" && e.Field != field {
		t.Fatalf("want %s on field %q, got field %q: %s", code, field, e.Field, e.Message)
	}
	if e.Message == "" {
		t.Fatalf("%s without a message", code)
	}
	return e
}

func mustOK(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// world is a root tenant with a platform site, a bcd pool and a pool
// without a daemon, plus a second tenant "acme" with its own admin key,
// custom site and bcd pool.
type world struct {
	e    *apitest.Env
	root string
	site *bcv1.Site
	pool *bcv1.Pool // root, agent bcd
	// pool2 is a second bcd pool of the root tenant on the same site.
	pool2   *bcv1.Pool
	noAgent *bcv1.Pool // root, agent none

	acme       string // second tenant
	acmeKey    string
	acmeAdmin  *client.Client
	acmeSite   *bcv1.Site
	acmePool   *bcv1.Pool
	rootAdminC *client.Client
}

func newWorld(t *testing.T, e *apitest.Env) *world {
	t.Helper()
	w := &world{e: e, root: e.RootTenant, rootAdminC: e.Admin}
	w.site = mkSite(t, e.Admin, e.RootTenant, "eu-1")
	w.pool = mkPool(t, e.Admin, e.RootTenant, w.site.Id, "gpu", "bcd")
	w.pool2 = mkPool(t, e.Admin, e.RootTenant, w.site.Id, "cpu", "bcd")
	w.noAgent = mkPool(t, e.Admin, e.RootTenant, w.site.Id, "bare", "none")
	w.acme, w.acmeKey, w.acmeAdmin = mkTenant(t, e, "acme")
	w.acmeSite = mkSite(t, w.acmeAdmin, w.acme, "acme-dc")
	w.acmePool = mkPool(t, w.acmeAdmin, w.acme, w.acmeSite.Id, "acme-gpu", "bcd")
	return w
}

func mkSite(t testing.TB, c *client.Client, tenant, name string) *bcv1.Site {
	t.Helper()
	s, err := c.Sites.CreateSite(context.Background(), rq(&bcv1.CreateSiteRequest{TenantId: tenant, Name: name}))
	mustOK(t, err)
	return s.Msg
}

func mkPool(t testing.TB, c *client.Client, tenant, site, name, agent string) *bcv1.Pool {
	t.Helper()
	p, err := c.Pools.CreatePool(context.Background(), rq(&bcv1.CreatePoolRequest{TenantId: tenant, SiteId: site, Name: name, Agent: agent}))
	mustOK(t, err)
	return p.Msg
}

// mkTenant has root create a tenant and an admin key in it (root principals
// may act for any tenant), and returns the tenant, the key and a client.
func mkTenant(t testing.TB, e *apitest.Env, name string) (string, string, *client.Client) {
	t.Helper()
	ctx := context.Background()
	tn, err := e.Admin.Tenants.CreateTenant(ctx, rq(&bcv1.CreateTenantRequest{Name: name}))
	mustOK(t, err)
	key := mkKey(t, e.Admin, tn.Msg.Id, name+"-admin", &bcv1.Grant{Action: "*", Resource: "*"})
	return tn.Msg.Id, key, e.Client(t, key)
}

func mkKey(t testing.TB, c *client.Client, tenant, name string, grants ...*bcv1.Grant) string {
	t.Helper()
	k, err := c.APIKeys.CreateApiKey(context.Background(), rq(&bcv1.CreateApiKeyRequest{TenantId: tenant, Name: name, Grants: grants}))
	mustOK(t, err)
	if !strings.HasPrefix(k.Msg.Key, "bck_key_") {
		t.Fatalf("api key = %q", k.Msg.Key)
	}
	return k.Msg.Key
}

func mkToken(t testing.TB, c *client.Client, r *bcv1.CreateJoinTokenRequest) *bcv1.JoinToken {
	t.Helper()
	if r.TtlSeconds == 0 {
		r.TtlSeconds = 3600
	}
	tok, err := c.JoinTokens.CreateJoinToken(context.Background(), rq(r))
	mustOK(t, err)
	return tok.Msg
}

// listAll walks every page of a pool's tokens.
func listAll(t testing.TB, c *client.Client, tenant, pool string, inactive bool, pageSize int32) []*bcv1.JoinToken {
	t.Helper()
	var out []*bcv1.JoinToken
	tok := ""
	for range 1000 {
		res, err := c.JoinTokens.ListJoinTokens(context.Background(), rq(&bcv1.ListJoinTokensRequest{TenantId: tenant, PoolId: pool,
			IncludeInactive: inactive, PageSize: pageSize, PageToken: tok}))
		mustOK(t, err)
		out = append(out, res.Msg.Items...)
		if res.Msg.NextPageToken == "" {
			return out
		}
		tok = res.Msg.NextPageToken
	}
	t.Fatal("list never ended")
	return nil
}

// eventsAfter reads a tenant's events after cursor until one satisfies
// until (or, with until nil, once), and returns them with the cursor after
// the last. On PostgreSQL an event is readable only once every older
// transaction in the cluster has ended, so readers poll.
func eventsAfter(t testing.TB, c *client.Client, tenant, cursor string, until func(*bcv1.Event) bool) ([]*bcv1.Event, string) {
	t.Helper()
	var out []*bcv1.Event
	poll.UntilDetail(t, 15*time.Second, func() string { return fmt.Sprintf("an awaited event among %d events of %s", len(out), tenant) }, func() bool {
		for {
			res, err := c.Events.ListEvents(context.Background(), rq(&bcv1.ListEventsRequest{TenantId: tenant, Cursor: cursor, Limit: 200}))
			mustOK(t, err)
			out = append(out, res.Msg.Events...)
			cursor = res.Msg.NextCursor
			if len(res.Msg.Events) < 200 {
				break
			}
		}
		return until == nil || slices.ContainsFunc(out, until)
	})
	return out, cursor
}

func isEvent(typ, subject string) func(*bcv1.Event) bool {
	return func(ev *bcv1.Event) bool { return ev.Type == typ && ev.Subject == subject }
}

// auditAll reads a tenant's audit rows, oldest first, through the API.
func auditAll(t testing.TB, c *client.Client, tenant string) []*bcv1.AuditEntry {
	t.Helper()
	var out []*bcv1.AuditEntry
	cur := ""
	for {
		res, err := c.Events.ListAudit(context.Background(), rq(&bcv1.ListAuditRequest{TenantId: tenant, PageSize: 200, Cursor: cur}))
		mustOK(t, err)
		out = append(out, res.Msg.Items...)
		if len(res.Msg.Items) < 200 {
			return out
		}
		cur = res.Msg.NextCursor
	}
}

// tokenRows reads a pool's join_tokens rows through the store.
func tokenRows(t testing.TB, db *store.DB, pool string) []store.JoinToken {
	t.Helper()
	var out []store.JoinToken
	err := db.ReadTx(context.Background(), func(tx *store.Tx) error {
		var err error
		out, err = tx.ListJoinTokens(context.Background(), pool, true, "", 100000)
		return err
	})
	mustOK(t, err)
	return out
}

// snapshot is what a failing call must leave unchanged: the tenant's token
// rows, events and audit rows.
type snapshot struct {
	tokens int
	cursor string
	audit  int
}

// settle returns a snapshot once the tenant's latest change is readable: it
// revokes a marker token (which publishes an event newer than everything
// before it) and waits for that event.
func settle(t testing.TB, w *world, tenant string, c *client.Client, pool string) snapshot {
	t.Helper()
	ctx := context.Background()
	marker := mkToken(t, c, &bcv1.CreateJoinTokenRequest{TenantId: tenant, PoolId: pool})
	_, err := c.JoinTokens.RevokeJoinToken(ctx, rq(&bcv1.RevokeJoinTokenRequest{TenantId: tenant, PoolId: pool, TokenId: marker.Id}))
	mustOK(t, err)
	_, cur := eventsAfter(t, w.e.Admin, tenant, "", isEvent("security.join-token.revoked", marker.Id))
	var n int
	err = w.e.DB.ReadTx(ctx, func(tx *store.Tx) error {
		for _, p := range []string{w.pool.Id, w.pool2.Id, w.noAgent.Id, w.acmePool.Id} {
			rows, err := tx.ListJoinTokens(ctx, p, true, "", 100000)
			if err != nil {
				return err
			}
			n += len(rows)
		}
		return nil
	})
	mustOK(t, err)
	return snapshot{tokens: n, cursor: cur, audit: len(auditAll(t, w.e.Admin, tenant))}
}

// unchanged checks that nothing was written since s: it settles again and
// expects exactly the new marker's two events, one more token row (the
// marker) and the marker's two audit rows.
func (s snapshot) unchanged(t testing.TB, w *world, tenant string, c *client.Client, pool string) {
	t.Helper()
	after := settle(t, w, tenant, c, pool)
	evs, _ := eventsAfter(t, w.e.Admin, tenant, s.cursor, nil)
	if len(evs) != 2 || evs[0].Type != "security.join-token.created" || evs[1].Type != "security.join-token.revoked" {
		var types []string
		for _, ev := range evs {
			types = append(types, ev.Type+" "+ev.Subject)
		}
		t.Fatalf("events written by failing calls: %v", types)
	}
	if after.tokens != s.tokens+1 {
		t.Fatalf("token rows: %d before, %d after (one marker expected)", s.tokens, after.tokens)
	}
	if after.audit != s.audit+2 {
		t.Fatalf("audit rows: %d before, %d after (two marker rows expected)", s.audit, after.audit)
	}
}
