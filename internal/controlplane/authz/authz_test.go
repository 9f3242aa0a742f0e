package authz_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/controlplane/authz"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/errs/errstest"
	"github.com/better-compute/better-compute/internal/shared/ids"
)

// R1.2: a grant pattern is exact, "*", or a prefix ending in "*", on both
// the action and the resource.
func TestAllowed(t *testing.T) {
	const pool = "compute-pool/pool_1"
	for _, tc := range []struct {
		name     string
		grants   []authz.Grant
		action   string
		resource string
		want     bool
	}{
		{"admin", authz.Admin, authz.JoinTokensCreate, pool, true},
		{"exact", []authz.Grant{{authz.JoinTokensCreate, pool}}, authz.JoinTokensCreate, pool, true},
		{"exact other action", []authz.Grant{{authz.JoinTokensCreate, pool}}, authz.JoinTokensRevoke, pool, false},
		{"exact other pool", []authz.Grant{{authz.JoinTokensCreate, pool}}, authz.JoinTokensCreate, "compute-pool/pool_2", false},
		{"action prefix", []authz.Grant{{"compute:join-tokens:*", pool}}, authz.JoinTokensRevoke, pool, true},
		{"action prefix stops at its text", []authz.Grant{{"compute:join-tokens:*", pool}}, authz.NodesRead, pool, false},
		{"resource prefix", []authz.Grant{{authz.NodesRead, "compute-pool/*"}}, authz.NodesRead, pool, true},
		{"resource prefix of another kind", []authz.Grant{{authz.NodesRead, "compute-pool/*"}}, authz.NodesRead, "compute-node/node_1", false},
		{"a prefix is no exact name", []authz.Grant{{authz.NodesRead, "compute-pool/pool_1"}}, authz.NodesRead, "compute-pool/pool_10", false},
		{"any of several", []authz.Grant{{authz.NodesRead, "compute-node/*"}, {authz.PoolsRead, "*"}}, authz.PoolsRead, pool, true},
		{"no grants", nil, authz.PoolsRead, pool, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := authz.Principal{TenantID: "tn_a", Grants: tc.grants}
			if got := p.Allowed(tc.action, tc.resource); got != tc.want {
				t.Fatalf("Allowed(%s, %s) = %v, want %v", tc.action, tc.resource, got, tc.want)
			}
		})
	}
}

// R1.2: grants are checked for shape before a key holds them.
func TestValidateGrants(t *testing.T) {
	many := make([]authz.Grant, 101)
	for i := range many {
		many[i] = authz.Grant{Action: "*", Resource: "*"}
	}
	for _, tc := range []struct {
		name   string
		grants []authz.Grant
		field  string
	}{
		{"admin", authz.Admin, ""},
		{"prefixes", []authz.Grant{{"compute:nodes:*", "compute-pool/*"}}, ""},
		{"empty action", []authz.Grant{{"", "*"}}, "grants[0].action"},
		{"empty resource", []authz.Grant{{"*", "*"}, {"*", ""}}, "grants[1].resource"},
		{"star inside", []authz.Grant{{"compute:*:read", "*"}}, "grants[0].action"},
		{"two stars", []authz.Grant{{"*", "compute-*/*"}}, "grants[0].resource"},
		{"space", []authz.Grant{{"compute:nodes:read ", "*"}}, "grants[0].action"},
		{"too long", []authz.Grant{{"*", strings.Repeat("r", 201)}}, "grants[0].resource"},
		{"too many", many, "grants"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := authz.ValidateGrants(tc.grants)
			if tc.field == "" {
				if err != nil {
					t.Fatal(err)
				}
				return
			}
			e, ok := errs.As(err)
			if !ok || e.Code != errs.InvalidArgument || e.Field != tc.field {
				t.Fatalf("want INVALID_ARGUMENT on %s, got %v", tc.field, err)
			}
		})
	}
}

// R1.2: the decision codes. Another tenant answers NOT_FOUND; a platform
// operator without the grant on another tenant's resource learns nothing
// either; only the caller's own tenant hears ACCESS_DENIED.
func TestRequire(t *testing.T) {
	narrow := []authz.Grant{{authz.PoolsRead, "compute-pool/pool_1"}}
	for _, tc := range []struct {
		name     string
		p        authz.Principal
		tenant   string
		action   string
		resource string
		code     errs.Code
		msg      string
	}{
		{"own tenant, granted", authz.Principal{TenantID: "tn_a", Grants: narrow}, "tn_a", authz.PoolsRead, "compute-pool/pool_1", "", ""},
		{"own tenant, outside the grants", authz.Principal{TenantID: "tn_a", Grants: narrow}, "tn_a", authz.PoolsRead, "compute-pool/pool_2",
			errs.AccessDenied, "compute:pools:read is not allowed on compute-pool/pool_2"},
		{"own tenant, other action", authz.Principal{TenantID: "tn_a", Grants: narrow}, "tn_a", authz.PoolsUpdate, "compute-pool/pool_1",
			errs.AccessDenied, "compute:pools:update is not allowed on compute-pool/pool_1"},
		{"another tenant, even with every grant", authz.Principal{TenantID: "tn_a", Grants: authz.Admin}, "tn_b", authz.PoolsRead, "compute-pool/pool_1",
			errs.NotFound, "tenant tn_b not found"},
		{"root for another tenant, granted", authz.Principal{TenantID: "tn_root", Root: true, Grants: authz.Admin}, "tn_b", authz.PoolsRead, "compute-pool/pool_1", "", ""},
		{"root for another tenant, not granted", authz.Principal{TenantID: "tn_root", Root: true, Grants: narrow}, "tn_b", authz.PoolsRead, "compute-pool/pool_9",
			errs.NotFound, "pool pool_9 not found"},
		{"root for another tenant, pattern", authz.Principal{TenantID: "tn_root", Root: true, Grants: narrow}, "tn_b", authz.PoolsCreate, "compute-pool/*",
			errs.NotFound, "tenant tn_b not found"},
		{"no tenant", authz.Principal{TenantID: "tn_a", Grants: authz.Admin}, "", authz.PoolsRead, "compute-pool/pool_1",
			errs.InvalidArgument, "tenantId: required"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.p.Require(tc.tenant, tc.action, tc.resource)
			if tc.code == "" {
				if err != nil {
					t.Fatal(err)
				}
				return
			}
			errstest.Want(t, err, tc.code, tc.msg)
		})
	}
}

// R1.1: names of tenants, sites, pools and keys; idempotency keys.
func TestValidNameAndIdempotencyKey(t *testing.T) {
	for _, tc := range []struct {
		name string
		ok   bool
	}{
		{"acme", true}, {"0-a.b_c", true}, {strings.Repeat("a", 63), true},
		{"", false}, {strings.Repeat("a", 64), false}, {"-acme", false}, {"Acme", false}, {"ac me", false}, {"ac/me", false},
	} {
		if err := authz.ValidName("name", tc.name); (err == nil) != tc.ok {
			t.Errorf("ValidName(%q) = %v, want ok=%v", tc.name, err, tc.ok)
		}
	}
	for _, tc := range []struct {
		key string
		ok  bool
	}{
		{"", true}, {"deploy-42/ü", true}, {strings.Repeat("k", authz.MaxIdempotencyKey), true},
		{strings.Repeat("k", authz.MaxIdempotencyKey+1), false}, {"a b", false}, {"a\tb", false}, {"a\x00", false},
	} {
		if err := authz.ValidIdempotencyKey("idempotencyKey", tc.key); (err == nil) != tc.ok {
			t.Errorf("ValidIdempotencyKey(%q) = %v, want ok=%v", tc.key, err, tc.ok)
		}
	}
}

// fixture is a root tenant and another tenant in a fresh store.
type fixture struct {
	db         *store.DB
	svc        *authz.Service
	root, acme string
}

func newFixture(t *testing.T, db *store.DB) *fixture {
	t.Helper()
	ctx := context.Background()
	f := &fixture{db: db, svc: authz.New(authz.Config{DB: db})}
	now := time.Now()
	err := db.WithTx(ctx, func(tx *store.Tx) error {
		root, err := tx.InsertTenant(ctx, ids.New(ids.Tenant, now), "root")
		if err != nil {
			return err
		}
		acme, err := tx.InsertTenant(ctx, ids.New(ids.Tenant, now), "acme")
		if err != nil {
			return err
		}
		f.root, f.acme = root.ID, acme.ID
		return tx.SetRootTenantID(ctx, root.ID)
	})
	if err != nil {
		t.Fatal(err)
	}
	return f
}

// key mints a key named name in tenant and returns its bearer form.
func (f *fixture) key(t *testing.T, tenant, name string, grants []authz.Grant, ttl time.Duration) (store.APIKeyRow, string) {
	t.Helper()
	ctx := context.Background()
	var row store.APIKeyRow
	var bearer string
	err := f.db.WithTx(ctx, func(tx *store.Tx) error {
		now, err := tx.Now(ctx)
		if err != nil {
			return err
		}
		row, bearer, err = authz.NewKey(ctx, tx, tenant, name, grants, ttl, now)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return row, bearer
}

// R1.2: a request carries the principal it speaks for; a context without
// one has none (the API then answers UNAUTHENTICATED).
func TestPrincipalInContext(t *testing.T) {
	if _, ok := authz.From(context.Background()); ok {
		t.Fatal("a bare context carries a principal")
	}
	p := authz.Principal{ID: "prn_1", TenantID: "tn_a", Name: "ci", KeyID: "key_1", Grants: authz.Admin}
	got, ok := authz.From(authz.WithPrincipal(context.Background(), p))
	if !ok || got.ID != p.ID || got.TenantID != p.TenantID || got.KeyID != p.KeyID || len(got.Grants) != 1 {
		t.Fatalf("From = %+v, %v; want %+v", got, ok, p)
	}
	for _, tc := range []struct {
		p      authz.Principal
		tenant string
		ok     bool
	}{
		{authz.Principal{TenantID: "tn_a"}, "tn_a", true},
		{authz.Principal{TenantID: "tn_a"}, "tn_b", false},
		{authz.Principal{TenantID: "tn_root", Root: true}, "tn_b", true},
	} {
		if err := tc.p.ActFor(tc.tenant); (err == nil) != tc.ok || (err != nil && !errs.Is(err, errs.NotFound)) {
			t.Errorf("%+v ActFor(%s) = %v, want ok=%v (else NOT_FOUND)", tc.p, tc.tenant, err, tc.ok)
		}
	}
}
