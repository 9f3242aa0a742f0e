package nodes_test

import (
	"context"
	"strings"
	"testing"

	"github.com/better-compute/better-compute/internal/controlplane/authz"
	"github.com/better-compute/better-compute/internal/controlplane/nodes"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/errs/errstest"
)

// R11.3: a deploy makes a node ahead of its machine: pending, identity
// generation 0, no key; decided on the pool; only for daemon pools.
func TestCreate(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		ctx := context.Background()
		f := newFixture(t, db)
		ok := nodes.CreateRequest{TenantID: f.acme, PoolID: f.gpu.ID, Hostname: "gpu-01.lab"}
		with := func(mod func(*nodes.CreateRequest)) nodes.CreateRequest { r := ok; mod(&r); return r }
		for _, tc := range []struct {
			name string
			p    authz.Principal
			r    nodes.CreateRequest
			code errs.Code
			msg  string
		}{
			{"bad hostname", f.admin, with(func(r *nodes.CreateRequest) { r.Hostname = "gpu_01" }), errs.InvalidArgument, ""},
			{"bad idempotency key", f.admin, with(func(r *nodes.CreateRequest) { r.IdempotencyKey = "a b" }), errs.InvalidArgument, ""},
			{"pool runs no daemon", f.admin, with(func(r *nodes.CreateRequest) { r.PoolID = f.ipmi.ID }), errs.InvalidState, ""},
			{"another tenant's pool", f.admin, with(func(r *nodes.CreateRequest) { r.PoolID = f.glob.ID }), errs.NotFound, "pool " + f.glob.ID + " not found"},
			{"another tenant", f.globAdm, ok, errs.NotFound, "tenant " + f.acme + " not found"},
			{"not granted on the pool", f.grants(authz.Grant{Action: authz.NodesCreate, Resource: authz.PoolResource(f.cpu.ID)}), ok,
				errs.AccessDenied, "compute:nodes:create is not allowed on compute-pool/" + f.gpu.ID},
		} {
			t.Run(tc.name, func(t *testing.T) {
				_, err := f.svc.Create(ctx, tc.p, tc.r)
				errstest.Want(t, err, tc.code, tc.msg)
			})
		}
		n, err := f.svc.Create(ctx, f.grants(authz.Grant{Action: authz.NodesCreate, Resource: authz.PoolResource(f.gpu.ID)}), ok)
		errstest.Must(t, err)
		if n.State != store.NodePending || n.IdentityGeneration != 0 || n.HardwareKey != nil || n.Hostname != "gpu-01.lab" ||
			n.PoolID != f.gpu.ID || n.SiteID != f.gpu.SiteID || n.Role != "node" {
			t.Fatalf("node made ahead = %+v", n)
		}
		if _, err := f.svc.Create(ctx, f.admin, with(func(r *nodes.CreateRequest) { r.Hostname = "" })); err != nil {
			t.Fatalf("no hostname: %v", err)
		}
		if got := f.events(t, f.acme, "node.created"); got != 2 {
			t.Fatalf("%d node.created events, want 2", got)
		}
	})
}

// R11.3: a retried create with the same idempotency key answers the node it
// made; another pool or hostname is a CONFLICT, and a key of another pool
// names nothing of it.
func TestCreateIdempotency(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		ctx := context.Background()
		f := newFixture(t, db)
		base := nodes.CreateRequest{TenantID: f.acme, PoolID: f.gpu.ID, Hostname: "gpu-01", IdempotencyKey: "deploy-7"}
		first, err := f.svc.Create(ctx, f.admin, base)
		errstest.Must(t, err)
		for _, tc := range []struct {
			name string
			r    nodes.CreateRequest
			msg  string
		}{
			{"same request", base, ""},
			{"other hostname", nodes.CreateRequest{TenantID: f.acme, PoolID: f.gpu.ID, Hostname: "gpu-02", IdempotencyKey: "deploy-7"},
				`idempotency key "deploy-7" was used for node ` + first.ID + " with another hostname"},
			{"other pool", nodes.CreateRequest{TenantID: f.acme, PoolID: f.cpu.ID, Hostname: "gpu-01", IdempotencyKey: "deploy-7"},
				`idempotency key "deploy-7" is already used in this tenant for another request; choose another key`},
		} {
			t.Run(tc.name, func(t *testing.T) {
				n, err := f.svc.Create(ctx, f.admin, tc.r)
				if tc.msg != "" {
					errstest.Want(t, err, errs.Conflict, tc.msg)
					if tc.r.PoolID != f.gpu.ID && strings.Contains(err.Error(), first.ID) {
						t.Fatal("a key of another pool must not name its node")
					}
					return
				}
				errstest.Must(t, err)
				if n.ID != first.ID {
					t.Fatalf("replay made %s, want %s", n.ID, first.ID)
				}
			})
		}
		if _, err := f.svc.Create(ctx, f.globAdm, nodes.CreateRequest{TenantID: f.globex, PoolID: f.glob.ID, IdempotencyKey: "deploy-7"}); err != nil {
			t.Fatalf("keys are per tenant: %v", err)
		}
		if got := f.events(t, f.acme, "node.created"); got != 1 {
			t.Fatalf("%d node.created events, want 1", got)
		}
	})
}

// R1.2: a node the caller may not read answers as a missing one does.
func TestGetAndList(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		ctx := context.Background()
		f := newFixture(t, db)
		n, _, _ := f.joined(t, f.gpu)
		onPool := f.grants(authz.Grant{Action: authz.NodesRead, Resource: authz.PoolResource(f.gpu.ID)})
		onNode := f.grants(authz.Grant{Action: authz.NodesRead, Resource: nodes.Resource(n.ID)})
		other := f.grants(authz.Grant{Action: authz.NodesRead, Resource: authz.PoolResource(f.cpu.ID)})
		notFound := "node " + n.ID + " not found"
		for _, tc := range []struct {
			name   string
			p      authz.Principal
			tenant string
			code   errs.Code
		}{
			{"read on the pool", onPool, f.acme, ""},
			{"read on the node", onNode, f.acme, ""},
			{"read on another pool", other, f.acme, errs.NotFound},
			{"another tenant", f.globAdm, f.globex, errs.NotFound},
		} {
			t.Run(tc.name, func(t *testing.T) {
				d, err := f.svc.Get(ctx, tc.p, tc.tenant, n.ID)
				if tc.code != "" {
					errstest.Want(t, err, tc.code, notFound)
					return
				}
				if err != nil || d.Node.ID != n.ID || len(d.Certs) != 1 {
					t.Fatalf("Get = %+v, %v; want the node with its certificate", d, err)
				}
			})
		}
		_, err := f.svc.Get(ctx, f.admin, f.acme, "node_missing")
		errstest.Want(t, err, errs.NotFound, "node node_missing not found")

		if l, err := f.svc.List(ctx, onPool, f.acme, f.gpu.ID, "", 100); err != nil || len(l) != 1 {
			t.Fatalf("list the pool: %d, %v", len(l), err)
		}
		_, err = f.svc.List(ctx, other, f.acme, f.gpu.ID, "", 100)
		errstest.Want(t, err, errs.NotFound, "pool "+f.gpu.ID+" not found")
		_, err = f.svc.List(ctx, onPool, f.acme, "", "", 100)
		errstest.Want(t, err, errs.AccessDenied, "compute:nodes:read is not allowed on compute-pool/*")
	})
}
