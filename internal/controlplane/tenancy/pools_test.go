package tenancy_test

import (
	"context"
	"errors"
	"reflect"
	"testing"

	"github.com/better-compute/better-compute/internal/controlplane/authz"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
	"github.com/better-compute/better-compute/internal/controlplane/tenancy"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/errs/errstest"
)

// R1.1: a pool lives on a site its tenant owns or a platform site, with an
// agent and a valid policy; R1.2: another tenant's site is NOT_FOUND.
func TestCreatePool(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		ctx := context.Background()
		f := newFixture(t, db)
		policy := tenancy.Policy{JoinAttestors: []string{"tpm"}, Discovery: tenancy.Discovery{Approval: tenancy.ApprovalAlways}}
		for _, tc := range []struct {
			name       string
			p          authz.Principal
			tenant     string
			site, pool string
			agent      string
			policy     tenancy.Policy
			code       errs.Code
			msg        string
		}{
			{"own site", f.acmeAdm, f.acme.ID, f.acmeSite.ID, "gpu", "bcd", policy, "", ""},
			{"platform site", f.globAdm, f.globex.ID, f.platformSite.ID, "gpu", "ipmi", tenancy.Policy{}, "", ""},
			{"another tenant's site", f.globAdm, f.globex.ID, f.acmeSite.ID, "x", "bcd", tenancy.Policy{}, errs.NotFound, "site " + f.acmeSite.ID + " not found"},
			{"no site", f.acmeAdm, f.acme.ID, "", "x", "bcd", tenancy.Policy{}, errs.InvalidArgument, "siteId: required"},
			{"bad agent", f.acmeAdm, f.acme.ID, f.acmeSite.ID, "x", "", tenancy.Policy{}, errs.InvalidArgument, ""},
			{"bad policy", f.acmeAdm, f.acme.ID, f.acmeSite.ID, "x", "bcd", tenancy.Policy{JoinAttestors: []string{"psk"}}, errs.InvalidArgument, ""},
			{"name taken on the site", f.acmeAdm, f.acme.ID, f.acmeSite.ID, "gpu", "bcd", tenancy.Policy{}, errs.AlreadyExists,
				`a pool named "gpu" exists on site ` + f.acmeSite.ID},
			{"not granted", authz.Principal{TenantID: f.acme.ID, Grants: []authz.Grant{{Action: authz.PoolsRead, Resource: "*"}}},
				f.acme.ID, f.acmeSite.ID, "y", "bcd", tenancy.Policy{}, errs.AccessDenied, "compute:pools:create is not allowed on compute-pool/*"},
		} {
			t.Run(tc.name, func(t *testing.T) {
				pool, err := f.svc.CreatePool(ctx, tc.p, tc.tenant, tc.site, tc.pool, tc.agent, tc.policy)
				if tc.code != "" {
					errstest.Want(t, err, tc.code, tc.msg)
					return
				}
				if err != nil {
					t.Fatal(err)
				}
				got, err := tenancy.ParsePolicy(pool.Policy)
				if err != nil || !reflect.DeepEqual(got, tc.policy) || pool.OwnerTenantID != tc.tenant || pool.SiteID != tc.site {
					t.Fatalf("pool = %+v (policy %+v, %v)", pool, got, err)
				}
			})
		}
	})
}

// R1.2: a pool is read only by its owner, through OwnedPool and PoolFor
// (the check every pool-scoped call makes): another tenant's pool and a
// missing one answer alike; a caller without the grant hears ACCESS_DENIED.
func TestPoolFor(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		ctx := context.Background()
		f := newFixture(t, db)
		pool, err := f.svc.CreatePool(ctx, f.acmeAdm, f.acme.ID, f.acmeSite.ID, "gpu", "bcd", tenancy.Policy{})
		if err != nil {
			t.Fatal(err)
		}
		reader := authz.Principal{TenantID: f.acme.ID, Grants: []authz.Grant{{Action: authz.PoolsRead, Resource: authz.PoolResource(pool.ID)}}}
		for _, tc := range []struct {
			name   string
			p      authz.Principal
			tenant string
			pool   string
			action string
			code   errs.Code
			msg    string
		}{
			{"owner", f.acmeAdm, f.acme.ID, pool.ID, authz.JoinTokensCreate, "", ""},
			{"granted on the pool", reader, f.acme.ID, pool.ID, authz.PoolsRead, "", ""},
			{"not granted", reader, f.acme.ID, pool.ID, authz.JoinTokensCreate, errs.AccessDenied,
				"compute:join-tokens:create is not allowed on compute-pool/" + pool.ID},
			{"another tenant's pool", f.globAdm, f.globex.ID, pool.ID, authz.PoolsRead, errs.NotFound, "pool " + pool.ID + " not found"},
			{"missing pool", f.acmeAdm, f.acme.ID, "pool_missing", authz.PoolsRead, errs.NotFound, "pool pool_missing not found"},
			{"no pool id", f.acmeAdm, f.acme.ID, "", authz.PoolsRead, errs.InvalidArgument, "poolId: required"},
		} {
			t.Run(tc.name, func(t *testing.T) {
				err := db.ReadTx(ctx, func(tx *store.Tx) error {
					_, err := tenancy.PoolFor(ctx, tx, tc.p, tc.tenant, tc.pool, tc.action)
					return err
				})
				if tc.code == "" {
					if err != nil {
						t.Fatal(err)
					}
				} else {
					errstest.Want(t, err, tc.code, tc.msg)
				}
				// GetPool decides the same way for compute:pools:read.
				if tc.action == authz.PoolsRead {
					_, err := f.svc.GetPool(ctx, tc.p, tc.tenant, tc.pool)
					if (err == nil) != (tc.code == "") || (err != nil && !errs.Is(err, tc.code)) {
						t.Fatalf("GetPool: %v, want %q", err, tc.code)
					}
				}
			})
		}
	})
}

// R1.1: a policy patch reads and writes in one transaction, keeping what
// it does not change; an invalid result and a failing patch change nothing.
func TestPatchPoolPolicy(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		ctx := context.Background()
		f := newFixture(t, db)
		start := tenancy.Policy{JoinAttestors: []string{"join-token"}, Acceptance: &tenancy.Acceptance{MinCPUs: 4}}
		pool, err := f.svc.CreatePool(ctx, f.acmeAdm, f.acme.ID, f.acmeSite.ID, "gpu", "bcd", start)
		if err != nil {
			t.Fatal(err)
		}
		setApproval := func(old tenancy.Policy) (tenancy.Policy, error) {
			old.Discovery.Approval = tenancy.ApprovalNever
			return old, nil
		}
		got, err := f.svc.PatchPoolPolicy(ctx, f.acmeAdm, f.acme.ID, pool.ID, setApproval)
		if err != nil {
			t.Fatal(err)
		}
		want := start
		want.Discovery.Approval = tenancy.ApprovalNever
		if p, _ := tenancy.ParsePolicy(got.Policy); !reflect.DeepEqual(p, want) {
			t.Fatalf("patched policy = %+v, want %+v", p, want)
		}

		boom := errors.New("boom")
		_, err = f.svc.PatchPoolPolicy(ctx, f.acmeAdm, f.acme.ID, pool.ID, func(tenancy.Policy) (tenancy.Policy, error) { return tenancy.Policy{}, boom })
		if !errors.Is(err, boom) {
			t.Fatalf("a failing patch: %v", err)
		}
		_, err = f.svc.PatchPoolPolicy(ctx, f.acmeAdm, f.acme.ID, pool.ID, func(p tenancy.Policy) (tenancy.Policy, error) {
			p.Discovery.Approval = "sometimes"
			return p, nil
		})
		errstest.Want(t, err, errs.InvalidArgument, "")
		_, err = f.svc.UpdatePoolPolicy(ctx, f.globAdm, f.globex.ID, pool.ID, tenancy.Policy{})
		errstest.Want(t, err, errs.NotFound, "pool "+pool.ID+" not found")
		reader := authz.Principal{TenantID: f.acme.ID, Grants: []authz.Grant{{Action: authz.PoolsRead, Resource: "*"}}}
		_, err = f.svc.UpdatePoolPolicy(ctx, reader, f.acme.ID, pool.ID, tenancy.Policy{})
		errstest.Want(t, err, errs.AccessDenied, "compute:pools:update is not allowed on compute-pool/"+pool.ID)

		after, err := f.svc.GetPool(ctx, f.acmeAdm, f.acme.ID, pool.ID)
		if p, _ := tenancy.ParsePolicy(after.Policy); err != nil || !reflect.DeepEqual(p, want) {
			t.Fatalf("after refused changes: %+v, %v; want %+v", p, err, want)
		}
	})
}
