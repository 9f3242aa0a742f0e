package authz_test

import (
	"bytes"
	"context"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/controlplane/authz"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/errs/errstest"
	"github.com/better-compute/better-compute/internal/shared/secret"
)

const unauthMsg = "a valid API key is required (Authorization: Bearer bck_…)"

// R1.2: a bearer key resolves to its principal; the secret is stored only
// as its SHA-256; every failure is the same UNAUTHENTICATED.
func TestAuthenticate(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		ctx := context.Background()
		f := newFixture(t, db)
		narrow := []authz.Grant{{authz.PoolsRead, "compute-pool/*"}}
		row, bearer := f.key(t, f.acme, "ci", narrow, 0)
		_, rootBearer := f.key(t, f.root, "ops", authz.Admin, 0)
		_, revoked := f.key(t, f.acme, "old", authz.Admin, 0)
		_, expiring := f.key(t, f.acme, "short", authz.Admin, time.Hour)
		if err := f.svc.RevokeKey(ctx, authz.Principal{TenantID: f.acme, Grants: authz.Admin}, f.acme, idOf(t, revoked)); err != nil {
			t.Fatal(err)
		}

		id, plain, ok := secret.Parse(authz.KeyScheme, bearer)
		if !ok || id != row.ID || !strings.HasPrefix(bearer, "bck_key_") {
			t.Fatalf("bearer %q: want bck_<key id>.<secret>", bearer)
		}
		if bytes.Contains(row.SecretSHA256, []byte(plain)) || !bytes.Equal(row.SecretSHA256, secret.Hash(plain)) {
			t.Fatal("the stored secret must be its SHA-256 only")
		}

		p, err := authz.Authenticate(ctx, db, bearer)
		if err != nil {
			t.Fatal(err)
		}
		if p.TenantID != f.acme || p.Name != "ci" || p.KeyID != row.ID || p.Root || !reflect.DeepEqual(p.Grants, narrow) {
			t.Fatalf("principal = %+v", p)
		}
		if p, err := authz.Authenticate(ctx, db, rootBearer); err != nil || !p.Root {
			t.Fatalf("a root tenant key: %+v, %v; want Root", p, err)
		}

		// Move compute_now() past the short key's expiry.
		if err := db.SetClockOffset(ctx, 2*time.Hour); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = db.SetClockOffset(context.Background(), 0) })
		for name, b := range map[string]string{
			"empty":          "",
			"other scheme":   "bcjt_" + strings.TrimPrefix(bearer, "bck_"),
			"no secret":      "bck_" + row.ID,
			"not a key id":   "bck_jt_" + strings.TrimPrefix(bearer, "bck_key_"),
			"wrong secret":   strings.TrimSuffix(bearer, plain[len(plain)-4:]) + "AAAA",
			"unknown key id": "bck_key_" + strings.Repeat("0", 26) + "." + plain,
			"revoked":        revoked,
			"expired":        expiring,
		} {
			t.Run(name, func(t *testing.T) {
				_, err := authz.Authenticate(ctx, db, b)
				errstest.Want(t, err, errs.Unauthenticated, unauthMsg)
			})
		}
	})
}

func idOf(t *testing.T, bearer string) string {
	t.Helper()
	id, _, ok := secret.Parse(authz.KeyScheme, bearer)
	if !ok {
		t.Fatalf("bearer %q does not parse", bearer)
	}
	return id
}

// R1.2: a key never grants what its creator does not hold, and a narrow key
// is refused outside its grants.
func TestCreateKey(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		ctx := context.Background()
		f := newFixture(t, db)
		admin := authz.Principal{ID: "prn_admin", TenantID: f.acme, Grants: authz.Admin}
		keys := authz.Principal{ID: "prn_keys", TenantID: f.acme, Grants: []authz.Grant{
			{authz.APIKeysCreate, "*"}, {"compute:nodes:*", "compute-pool/pool_1"}}}
		for _, tc := range []struct {
			name   string
			p      authz.Principal
			tenant string
			key    string
			grants []authz.Grant
			ttl    time.Duration
			code   errs.Code
			msg    string
		}{
			{"subset of the creator's", keys, f.acme, "reader", []authz.Grant{{authz.NodesRead, "compute-pool/pool_1"}}, time.Hour, "", ""},
			{"narrower prefix", keys, f.acme, "nodes", []authz.Grant{{"compute:nodes:re*", "compute-pool/pool_1"}}, 0, "", ""},
			{"wider action", keys, f.acme, "wide", []authz.Grant{{"compute:*", "compute-pool/pool_1"}}, 0,
				errs.AccessDenied, "grants[0]: you cannot grant compute:* on compute-pool/pool_1"},
			{"another pool", keys, f.acme, "other", []authz.Grant{{authz.NodesRead, "compute-pool/pool_2"}}, 0,
				errs.AccessDenied, "grants[0]: you cannot grant compute:nodes:read on compute-pool/pool_2"},
			{"no right to create keys", authz.Principal{TenantID: f.acme, Grants: []authz.Grant{{authz.NodesRead, "*"}}}, f.acme, "x", authz.Admin, 0,
				errs.AccessDenied, "compute:api-keys:create is not allowed on compute-tenant/" + f.acme},
			{"another tenant", admin, f.root, "x", authz.Admin, 0, errs.NotFound, "tenant " + f.root + " not found"},
			{"no grants", admin, f.acme, "x", nil, 0, errs.InvalidArgument, "grants: at least one grant is required"},
			{"bad name", admin, f.acme, "X", authz.Admin, 0, errs.InvalidArgument, ""},
			{"negative ttl", admin, f.acme, "x", authz.Admin, -time.Second, errs.InvalidArgument, "ttlSeconds: 0 (no expiry) up to ten years"},
			{"ttl over ten years", admin, f.acme, "x", authz.Admin, 3651 * 24 * time.Hour, errs.InvalidArgument, "ttlSeconds: 0 (no expiry) up to ten years"},
			{"name taken", admin, f.acme, "reader", authz.Admin, 0, errs.AlreadyExists, `an API key named "reader" exists in this tenant`},
		} {
			t.Run(tc.name, func(t *testing.T) {
				row, bearer, err := f.svc.CreateKey(ctx, tc.p, tc.tenant, tc.key, tc.grants, tc.ttl)
				if tc.code != "" {
					errstest.Want(t, err, tc.code, tc.msg)
					return
				}
				if err != nil {
					t.Fatal(err)
				}
				if tc.ttl > 0 && (row.ExpiresAt == nil || !row.ExpiresAt.After(row.CreatedAt)) {
					t.Fatalf("expiresAt = %v, want set", row.ExpiresAt)
				}
				p, err := authz.Authenticate(ctx, db, bearer)
				if err != nil {
					t.Fatal(err)
				}
				// The new key is refused outside its grants.
				if err := p.Require(f.acme, authz.NodesUpdate, "compute-pool/pool_2"); !errs.Is(err, errs.AccessDenied) {
					t.Fatalf("outside its grants: %v, want ACCESS_DENIED", err)
				}
			})
		}
	})
}

// R1.2: revoking a key ends it at once; again is not an error; another
// tenant's key is NOT_FOUND.
func TestRevokeKey(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		ctx := context.Background()
		f := newFixture(t, db)
		admin := authz.Principal{ID: "prn_admin", TenantID: f.acme, Grants: authz.Admin}
		row, bearer := f.key(t, f.acme, "ci", authz.Admin, 0)
		_, rootBearer := f.key(t, f.root, "ops", authz.Admin, 0)
		for i := 0; i < 2; i++ {
			if err := f.svc.RevokeKey(ctx, admin, f.acme, row.ID); err != nil {
				t.Fatalf("revoke %d: %v", i, err)
			}
		}
		if _, err := authz.Authenticate(ctx, db, bearer); !errs.Is(err, errs.Unauthenticated) {
			t.Fatalf("revoked key: %v", err)
		}
		rootKey := idOf(t, rootBearer)
		errstest.Want(t, f.svc.RevokeKey(ctx, admin, f.acme, rootKey), errs.NotFound, "API key "+rootKey+" not found")
		if _, err := authz.Authenticate(ctx, db, rootBearer); err != nil {
			t.Fatalf("another tenant's key must live on: %v", err)
		}
		list, err := f.svc.ListKeys(ctx, admin, f.acme, "", 10)
		if err != nil || len(list) != 1 || list[0].RevokedAt == nil {
			t.Fatalf("list = %+v, %v; want the one revoked key", list, err)
		}
	})
}
