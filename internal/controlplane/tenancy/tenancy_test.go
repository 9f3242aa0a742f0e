package tenancy_test

import (
	"context"
	"testing"

	"github.com/better-compute/better-compute/internal/controlplane/authz"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
	"github.com/better-compute/better-compute/internal/controlplane/tenancy"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/errs/errstest"
)

// fixture is a bootstrapped deployment with two customer tenants, a
// platform site, and a custom site of acme.
type fixture struct {
	svc                    *tenancy.Service
	root, acme, globex     store.Tenant
	ops, acmeAdm, globAdm  authz.Principal
	platformSite, acmeSite store.Site
}

func newFixture(t *testing.T, db *store.DB) *fixture {
	t.Helper()
	ctx := context.Background()
	f := &fixture{svc: tenancy.New(tenancy.Config{DB: db})}
	var err error
	if f.root, _, err = f.svc.Bootstrap(ctx, "root"); err != nil {
		t.Fatal(err)
	}
	f.ops = authz.Principal{ID: "prn_ops", TenantID: f.root.ID, Root: true, Grants: authz.Admin}
	if f.acme, err = f.svc.CreateTenant(ctx, f.ops, "acme"); err != nil {
		t.Fatal(err)
	}
	if f.globex, err = f.svc.CreateTenant(ctx, f.ops, "globex"); err != nil {
		t.Fatal(err)
	}
	f.acmeAdm = authz.Principal{ID: "prn_acme", TenantID: f.acme.ID, Grants: authz.Admin}
	f.globAdm = authz.Principal{ID: "prn_globex", TenantID: f.globex.ID, Grants: authz.Admin}
	if f.platformSite, err = f.svc.CreateSite(ctx, f.ops, f.root.ID, "eu-1", "eu"); err != nil {
		t.Fatal(err)
	}
	if f.acmeSite, err = f.svc.CreateSite(ctx, f.acmeAdm, f.acme.ID, "lab", ""); err != nil {
		t.Fatal(err)
	}
	return f
}

// R1.1: the deployment names one root tenant; bootstrapping again answers
// it unchanged.
func TestBootstrap(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		ctx := context.Background()
		svc := tenancy.New(tenancy.Config{DB: db})
		if id, err := svc.RootTenantID(ctx); err != nil || id != "" {
			t.Fatalf("before bootstrap: %q, %v", id, err)
		}
		_, _, err := svc.Bootstrap(ctx, "Root")
		errstest.Want(t, err, errs.InvalidArgument, "")
		first, created, err := svc.Bootstrap(ctx, "root")
		if err != nil || !created {
			t.Fatalf("first bootstrap: created=%v, %v", created, err)
		}
		again, created, err := svc.Bootstrap(ctx, "other")
		if err != nil || created || again.ID != first.ID || again.Name != "root" {
			t.Fatalf("second bootstrap = %+v created=%v, %v; want the first root", again, created, err)
		}
		if id, _ := svc.RootTenantID(ctx); id != first.ID {
			t.Fatalf("root = %q, want %q", id, first.ID)
		}
	})
}

// R1.1, R1.2: only platform operators create tenants; a customer sees its
// own tenant only, and another tenant is NOT_FOUND.
func TestTenants(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		ctx := context.Background()
		f := newFixture(t, db)
		_, err := f.svc.CreateTenant(ctx, f.acmeAdm, "initech")
		errstest.Want(t, err, errs.AccessDenied, "only platform operators with compute:tenants:create may create tenants")
		narrowOps := authz.Principal{TenantID: f.root.ID, Root: true, Grants: []authz.Grant{{Action: authz.TenantsRead, Resource: "*"}}}
		_, err = f.svc.CreateTenant(ctx, narrowOps, "initech")
		errstest.Want(t, err, errs.AccessDenied, "")
		_, err = f.svc.CreateTenant(ctx, f.ops, "acme")
		errstest.Want(t, err, errs.AlreadyExists, `a tenant named "acme" exists`)

		_, err = f.svc.GetTenant(ctx, f.acmeAdm, f.globex.ID)
		errstest.Want(t, err, errs.NotFound, "tenant "+f.globex.ID+" not found")
		if got, err := f.svc.GetTenant(ctx, f.ops, f.globex.ID); err != nil || got.Name != "globex" {
			t.Fatalf("operator reads globex: %+v, %v", got, err)
		}
		own, err := f.svc.ListTenants(ctx, f.acmeAdm, "", 100)
		if err != nil || len(own) != 1 || own[0].ID != f.acme.ID {
			t.Fatalf("acme lists %+v, %v; want only acme", own, err)
		}
		all, err := f.svc.ListTenants(ctx, f.ops, "", 100)
		if err != nil || len(all) != 3 {
			t.Fatalf("operator lists %d tenants, %v; want 3", len(all), err)
		}
	})
}

// R1.1: a root tenant's site is a platform site every tenant sees; any
// other tenant's is custom and its own (R1.2: NOT_FOUND to others).
func TestSites(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		ctx := context.Background()
		f := newFixture(t, db)
		if f.platformSite.Custom || !f.acmeSite.Custom {
			t.Fatalf("custom: platform %v, acme %v; want false, true", f.platformSite.Custom, f.acmeSite.Custom)
		}
		for _, tc := range []struct {
			name   string
			p      authz.Principal
			tenant string
			site   string
			code   errs.Code
		}{
			{"own site", f.acmeAdm, f.acme.ID, f.acmeSite.ID, ""},
			{"platform site", f.globAdm, f.globex.ID, f.platformSite.ID, ""},
			{"another tenant's site", f.globAdm, f.globex.ID, f.acmeSite.ID, errs.NotFound},
			{"missing site", f.acmeAdm, f.acme.ID, "site_missing", errs.NotFound},
		} {
			t.Run(tc.name, func(t *testing.T) {
				_, err := f.svc.GetSite(ctx, tc.p, tc.tenant, tc.site)
				if tc.code == "" {
					if err != nil {
						t.Fatal(err)
					}
					return
				}
				errstest.Want(t, err, tc.code, "site "+tc.site+" not found")
			})
		}
		globex, err := f.svc.ListSites(ctx, f.globAdm, f.globex.ID, "", 100)
		if err != nil || len(globex) != 1 || globex[0].ID != f.platformSite.ID {
			t.Fatalf("globex lists %+v, %v; want the platform site only", globex, err)
		}
		_, err = f.svc.CreateSite(ctx, f.acmeAdm, f.acme.ID, "lab", "")
		errstest.Want(t, err, errs.AlreadyExists, `a site named "lab" exists in this tenant`)
		if _, err := f.svc.CreateSite(ctx, f.globAdm, f.globex.ID, "lab", ""); err != nil {
			t.Fatalf("site names are per tenant: %v", err)
		}
		_, err = f.svc.CreateSite(ctx, f.acmeAdm, f.acme.ID, "lab-2", "EU West")
		errstest.Want(t, err, errs.InvalidArgument, "")
		_, err = f.svc.CreateSite(ctx, f.acmeAdm, f.globex.ID, "x", "")
		errstest.Want(t, err, errs.NotFound, "tenant "+f.globex.ID+" not found")
	})
}
