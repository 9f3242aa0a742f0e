package api_test

import (
	"context"
	"strings"
	"testing"
	"time"

	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
	"github.com/better-compute/better-compute/internal/controlplane/apitest"
	"github.com/better-compute/better-compute/internal/shared/errs"
)

// R1.2: every call needs a live API key; every failure is the same
// UNAUTHENTICATED.
func TestAuthentication(t *testing.T) {
	apitest.Each(t, apitest.Options{NoJoin: true}, func(t *testing.T, e *apitest.Env) {
		w := newWorld(t, e)
		ctx := context.Background()
		tok := mkToken(t, e.Admin, &bcv1.CreateJoinTokenRequest{TenantId: w.root, PoolId: w.pool.Id})

		revokedKey := mkKey(t, e.Admin, w.root, "soon-revoked", &bcv1.Grant{Action: "*", Resource: "*"})
		keys, err := e.Admin.APIKeys.ListApiKeys(ctx, rq(&bcv1.ListApiKeysRequest{TenantId: w.root}))
		mustOK(t, err)
		var revokedID string
		for _, k := range keys.Msg.Items {
			if k.Name == "soon-revoked" {
				revokedID = k.Id
			}
		}
		if revokedID == "" || !strings.HasPrefix(revokedKey, "bck_"+revokedID+".") {
			t.Fatalf("key %s not listed", revokedKey)
		}
		// The key works until it is revoked.
		_, err = e.Client(t, revokedKey).JoinTokens.ListJoinTokens(ctx, rq(&bcv1.ListJoinTokensRequest{TenantId: w.root, PoolId: w.pool.Id}))
		mustOK(t, err)
		_, err = e.Admin.APIKeys.RevokeApiKey(ctx, rq(&bcv1.RevokeApiKeyRequest{TenantId: w.root, ApiKeyId: revokedID}))
		mustOK(t, err)

		// An expiring key, expired by moving the database clock below.
		ek, err := e.Admin.APIKeys.CreateApiKey(ctx, rq(&bcv1.CreateApiKeyRequest{TenantId: w.root, Name: "short", TtlSeconds: 60,
			Grants: []*bcv1.Grant{{Action: "*", Resource: "*"}}}))
		mustOK(t, err)
		_, err = e.Client(t, ek.Msg.Key).JoinTokens.ListJoinTokens(ctx, rq(&bcv1.ListJoinTokensRequest{TenantId: w.root, PoolId: w.pool.Id}))
		mustOK(t, err)

		id, secret, _ := strings.Cut(strings.TrimPrefix(e.AdminKey, "bck_"), ".")
		wrongSecret := "bck_" + id + "." + strings.Repeat("A", len(secret))
		cases := []struct{ name, key string }{
			{"missing", ""},
			{"garbage", "nope"},
			{"unknown key", "bck_key_01k5w0000000000000000000aa." + secret},
			{"wrong secret", wrongSecret},
			{"truncated", e.AdminKey[:len(e.AdminKey)-1]},
			{"a join token", tok.Token},
			{"revoked", revokedKey},
		}
		var msg string
		check := func(t *testing.T, key string) {
			c := e.Client(t, key)
			calls := map[string]func() error{
				"create": func() error {
					_, err := c.JoinTokens.CreateJoinToken(ctx, rq(&bcv1.CreateJoinTokenRequest{TenantId: w.root, PoolId: w.pool.Id, TtlSeconds: 3600}))
					return err
				},
				"list": func() error {
					_, err := c.JoinTokens.ListJoinTokens(ctx, rq(&bcv1.ListJoinTokensRequest{TenantId: w.root, PoolId: w.pool.Id}))
					return err
				},
				"tenants": func() error {
					_, err := c.Tenants.ListTenants(ctx, rq(&bcv1.ListTenantsRequest{}))
					return err
				},
				"events": func() error {
					_, err := c.Events.ListEvents(ctx, rq(&bcv1.ListEventsRequest{TenantId: w.root}))
					return err
				},
			}
			for name, call := range calls {
				ee := wantErr(t, call(), errs.Unauthenticated, "")
				// One message, whatever was wrong.
				if msg == "" {
					msg = ee.Message
				} else if ee.Message != msg {
					t.Fatalf("%s: message %q differs from %q", name, ee.Message, msg)
				}
			}
		}
		for _, c := range cases {
			t.Run(c.name, func(t *testing.T) { check(t, c.key) })
		}
		mustOK(t, e.DB.SetClockOffset(ctx, 2*time.Minute))
		t.Run("expired", func(t *testing.T) { check(t, ek.Msg.Key) })
		if rows := tokenRows(t, e.DB, w.pool.Id); len(rows) != 1 {
			t.Fatalf("%d token rows after refused creates", len(rows))
		}
	})
}

// R1.2: a key holds only its grants, cannot grant more, and another
// tenant's resources are NOT_FOUND.
func TestAuthorization(t *testing.T) {
	apitest.Each(t, apitest.Options{NoJoin: true}, func(t *testing.T, e *apitest.Env) {
		w := newWorld(t, e)
		ctx := context.Background()
		poolRes := "compute-pool/" + w.pool.Id
		tok := mkToken(t, e.Admin, &bcv1.CreateJoinTokenRequest{TenantId: w.root, PoolId: w.pool.Id})
		reader := e.Client(t, mkKey(t, e.Admin, w.root, "reader", &bcv1.Grant{Action: "compute:join-tokens:read", Resource: poolRes}))
		snap := settle(t, w, w.root, e.Admin, w.pool.Id)

		t.Run("read only", func(t *testing.T) {
			// R1.2, R2.5: compute:join-tokens:read on the pool lists it...
			res, err := reader.JoinTokens.ListJoinTokens(ctx, rq(&bcv1.ListJoinTokensRequest{TenantId: w.root, PoolId: w.pool.Id, IncludeInactive: true}))
			mustOK(t, err)
			if len(res.Msg.Items) == 0 || res.Msg.Items[0].Id != tok.Id {
				t.Fatalf("reader lists %v", res.Msg.Items)
			}
			// ...and nothing else.
			denied := map[string]func() error{
				"create": func() error {
					_, err := reader.JoinTokens.CreateJoinToken(ctx, rq(&bcv1.CreateJoinTokenRequest{TenantId: w.root, PoolId: w.pool.Id, TtlSeconds: 3600}))
					return err
				},
				"revoke": func() error {
					_, err := reader.JoinTokens.RevokeJoinToken(ctx, rq(&bcv1.RevokeJoinTokenRequest{TenantId: w.root, PoolId: w.pool.Id, TokenId: tok.Id}))
					return err
				},
				"list another pool": func() error {
					_, err := reader.JoinTokens.ListJoinTokens(ctx, rq(&bcv1.ListJoinTokensRequest{TenantId: w.root, PoolId: w.pool2.Id}))
					return err
				},
				"get pool": func() error {
					_, err := reader.Pools.GetPool(ctx, rq(&bcv1.GetPoolRequest{TenantId: w.root, PoolId: w.pool.Id}))
					return err
				},
				"create key": func() error {
					_, err := reader.APIKeys.CreateApiKey(ctx, rq(&bcv1.CreateApiKeyRequest{TenantId: w.root, Name: "more",
						Grants: []*bcv1.Grant{{Action: "compute:join-tokens:read", Resource: poolRes}}}))
					return err
				},
				"create tenant": func() error {
					_, err := reader.Tenants.CreateTenant(ctx, rq(&bcv1.CreateTenantRequest{Name: "evil"}))
					return err
				},
				"events": func() error {
					_, err := reader.Events.ListEvents(ctx, rq(&bcv1.ListEventsRequest{TenantId: w.root}))
					return err
				},
			}
			for name, call := range denied {
				t.Run(name, func(t *testing.T) {
					ee := wantErr(t, call(), errs.AccessDenied, "")
					if !strings.Contains(ee.Message, "compute:") {
						t.Fatalf("message %q names no action", ee.Message)
					}
				})
			}
			// Another tenant's pool stays NOT_FOUND for it too.
			_, err = reader.JoinTokens.ListJoinTokens(ctx, rq(&bcv1.ListJoinTokensRequest{TenantId: w.root, PoolId: w.acmePool.Id}))
			wantErr(t, err, errs.NotFound, "")
			// The reader is a platform principal (root tenant), so it may
			// act for acme, but without a grant on acme's pool the answer
			// is the one a missing pool gets: no existence oracle.
			_, err = reader.JoinTokens.ListJoinTokens(ctx, rq(&bcv1.ListJoinTokensRequest{TenantId: w.acme, PoolId: w.acmePool.Id}))
			exists := wantErr(t, err, errs.NotFound, "")
			const missing = "pool_01k5w0000000000000000000aa"
			_, err = reader.JoinTokens.ListJoinTokens(ctx, rq(&bcv1.ListJoinTokensRequest{TenantId: w.acme, PoolId: missing}))
			absent := wantErr(t, err, errs.NotFound, "")
			if strings.ReplaceAll(exists.Message, w.acmePool.Id, "P") != strings.ReplaceAll(absent.Message, missing, "P") {
				t.Fatalf("an existing and a missing pool answer differently: %q, %q", exists.Message, absent.Message)
			}
		})
		// The refusals wrote nothing.
		snap.unchanged(t, w, w.root, e.Admin, w.pool.Id)

		t.Run("no escalation", func(t *testing.T) {
			// A key that may create keys still cannot grant what it does
			// not hold.
			minter := e.Client(t, mkKey(t, e.Admin, w.root, "minter",
				&bcv1.Grant{Action: "compute:api-keys:create", Resource: "compute-tenant/" + w.root},
				&bcv1.Grant{Action: "compute:join-tokens:read", Resource: poolRes}))
			refused := []struct {
				name  string
				grant *bcv1.Grant
			}{
				{"another action", &bcv1.Grant{Action: "compute:join-tokens:create", Resource: poolRes}},
				{"a wider action", &bcv1.Grant{Action: "compute:join-tokens:*", Resource: poolRes}},
				{"a wider resource", &bcv1.Grant{Action: "compute:join-tokens:read", Resource: "compute-pool/*"}},
				{"another resource", &bcv1.Grant{Action: "compute:join-tokens:read", Resource: "compute-pool/" + w.pool2.Id}},
				{"everything", &bcv1.Grant{Action: "*", Resource: "*"}},
			}
			for i, c := range refused {
				t.Run(c.name, func(t *testing.T) {
					_, err := minter.APIKeys.CreateApiKey(ctx, rq(&bcv1.CreateApiKeyRequest{TenantId: w.root, Name: "k" + string(rune('a'+i)),
						Grants: []*bcv1.Grant{{Action: "compute:join-tokens:read", Resource: poolRes}, c.grant}}))
					ee := wantErr(t, err, errs.AccessDenied, "")
					if !strings.Contains(ee.Message, "grants[1]") {
						t.Fatalf("message %q does not name grants[1]", ee.Message)
					}
				})
			}
			// What it holds, it may pass on; the new key works.
			k, err := minter.APIKeys.CreateApiKey(ctx, rq(&bcv1.CreateApiKeyRequest{TenantId: w.root, Name: "sub",
				Grants: []*bcv1.Grant{{Action: "compute:join-tokens:read", Resource: poolRes}}}))
			mustOK(t, err)
			_, err = e.Client(t, k.Msg.Key).JoinTokens.ListJoinTokens(ctx, rq(&bcv1.ListJoinTokensRequest{TenantId: w.root, PoolId: w.pool.Id}))
			mustOK(t, err)
			// Nor can it mint a key in another tenant.
			_, err = minter.APIKeys.CreateApiKey(ctx, rq(&bcv1.CreateApiKeyRequest{TenantId: w.acme, Name: "sub",
				Grants: []*bcv1.Grant{{Action: "compute:join-tokens:read", Resource: poolRes}}}))
			wantErr(t, err, errs.NotFound, "")
			// A tenant admin cannot create tenants: that is the platform's.
			_, err = w.acmeAdmin.Tenants.CreateTenant(ctx, rq(&bcv1.CreateTenantRequest{Name: "acme-2"}))
			wantErr(t, err, errs.AccessDenied, "")
		})

		t.Run("other tenants are NOT_FOUND", func(t *testing.T) {
			// A third tenant with a custom site and a pool.
			globex, _, globexAdmin := mkTenant(t, e, "globex")
			gSite := mkSite(t, globexAdmin, globex, "globex-dc")
			gPool := mkPool(t, globexAdmin, globex, gSite.Id, "g", "bcd")
			acmeReader := e.Client(t, mkKey(t, w.acmeAdmin, w.acme, "acme-reader", &bcv1.Grant{Action: "compute:join-tokens:read", Resource: "compute-pool/" + w.acmePool.Id}))
			type call func() error
			cases := []struct {
				name string
				f    call
			}{
				{"acme gets root tenant", func() error {
					_, err := w.acmeAdmin.Tenants.GetTenant(ctx, rq(&bcv1.GetTenantRequest{TenantId: w.root}))
					return err
				}},
				{"acme gets globex tenant", func() error {
					_, err := w.acmeAdmin.Tenants.GetTenant(ctx, rq(&bcv1.GetTenantRequest{TenantId: globex}))
					return err
				}},
				{"acme gets globex site as acme", func() error {
					_, err := w.acmeAdmin.Sites.GetSite(ctx, rq(&bcv1.GetSiteRequest{TenantId: w.acme, SiteId: gSite.Id}))
					return err
				}},
				{"acme gets globex site as globex", func() error {
					_, err := w.acmeAdmin.Sites.GetSite(ctx, rq(&bcv1.GetSiteRequest{TenantId: globex, SiteId: gSite.Id}))
					return err
				}},
				{"root gets acme's custom site as root", func() error {
					_, err := e.Admin.Sites.GetSite(ctx, rq(&bcv1.GetSiteRequest{TenantId: w.root, SiteId: w.acmeSite.Id}))
					return err
				}},
				{"acme gets root pool as acme", func() error {
					_, err := w.acmeAdmin.Pools.GetPool(ctx, rq(&bcv1.GetPoolRequest{TenantId: w.acme, PoolId: w.pool.Id}))
					return err
				}},
				{"acme gets root pool as root", func() error {
					_, err := w.acmeAdmin.Pools.GetPool(ctx, rq(&bcv1.GetPoolRequest{TenantId: w.root, PoolId: w.pool.Id}))
					return err
				}},
				{"acme gets globex pool", func() error {
					_, err := w.acmeAdmin.Pools.GetPool(ctx, rq(&bcv1.GetPoolRequest{TenantId: w.acme, PoolId: gPool.Id}))
					return err
				}},
				{"acme reader gets globex pool", func() error {
					_, err := acmeReader.Pools.GetPool(ctx, rq(&bcv1.GetPoolRequest{TenantId: w.acme, PoolId: gPool.Id}))
					return err
				}},
				{"acme lists root pools", func() error {
					_, err := w.acmeAdmin.Pools.ListPools(ctx, rq(&bcv1.ListPoolsRequest{TenantId: w.root}))
					return err
				}},
				{"acme lists root keys", func() error {
					_, err := w.acmeAdmin.APIKeys.ListApiKeys(ctx, rq(&bcv1.ListApiKeysRequest{TenantId: w.root}))
					return err
				}},
				{"acme lists globex tokens", func() error {
					_, err := w.acmeAdmin.JoinTokens.ListJoinTokens(ctx, rq(&bcv1.ListJoinTokensRequest{TenantId: w.acme, PoolId: gPool.Id}))
					return err
				}},
				{"acme creates a pool on globex site", func() error {
					_, err := w.acmeAdmin.Pools.CreatePool(ctx, rq(&bcv1.CreatePoolRequest{TenantId: w.acme, SiteId: gSite.Id, Name: "x", Agent: "bcd"}))
					return err
				}},
				{"acme updates root pool", func() error {
					_, err := w.acmeAdmin.Pools.UpdatePoolPolicy(ctx, rq(&bcv1.UpdatePoolPolicyRequest{TenantId: w.acme, PoolId: w.pool.Id, Policy: &bcv1.PoolPolicy{}}))
					return err
				}},
				{"root gets an unknown tenant", func() error {
					_, err := e.Admin.Tenants.GetTenant(ctx, rq(&bcv1.GetTenantRequest{TenantId: "tn_01k5w0000000000000000000aa"}))
					return err
				}},
			}
			for _, c := range cases {
				t.Run(c.name, func(t *testing.T) { wantErr(t, c.f(), errs.NotFound, "") })
			}
			// What they may see: their own, and the platform's sites (R1.1).
			_, err := w.acmeAdmin.Sites.GetSite(ctx, rq(&bcv1.GetSiteRequest{TenantId: w.acme, SiteId: w.site.Id}))
			mustOK(t, err)
			_, err = e.Admin.Sites.GetSite(ctx, rq(&bcv1.GetSiteRequest{TenantId: w.acme, SiteId: w.acmeSite.Id}))
			mustOK(t, err)
			ts, err := w.acmeAdmin.Tenants.ListTenants(ctx, rq(&bcv1.ListTenantsRequest{}))
			mustOK(t, err)
			if len(ts.Msg.Items) != 1 || ts.Msg.Items[0].Id != w.acme || ts.Msg.Items[0].Root {
				t.Fatalf("acme lists tenants %v", ts.Msg.Items)
			}
			ps, err := w.acmeAdmin.Pools.ListPools(ctx, rq(&bcv1.ListPoolsRequest{TenantId: w.acme}))
			mustOK(t, err)
			if len(ps.Msg.Items) != 1 || ps.Msg.Items[0].Id != w.acmePool.Id {
				t.Fatalf("acme lists pools %v", ps.Msg.Items)
			}
		})
	})
}
