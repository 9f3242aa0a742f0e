package nodes_test

import (
	"context"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/controlplane/authz"
	"github.com/better-compute/better-compute/internal/controlplane/nodes"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/tenancy"
	"github.com/better-compute/better-compute/internal/shared/errs/errstest"
	"github.com/better-compute/better-compute/internal/shared/ids"
)

// fixture is acme with two daemon pools and one that runs no daemon, and
// globex with one pool. ended receives the nodes whose session Retire
// ended: after the commit, on the store's writer, so tests wait for it.
type fixture struct {
	db                   *store.DB
	svc                  *nodes.Service
	acme, globex         string
	admin, globAdm       authz.Principal
	gpu, cpu, ipmi, glob store.Pool
	ended                chan string
}

func newFixture(t *testing.T, db *store.DB) *fixture {
	t.Helper()
	ctx := context.Background()
	ten := tenancy.New(tenancy.Config{DB: db})
	root, _, err := ten.Bootstrap(ctx, "root")
	errstest.Must(t, err)
	ops := authz.Principal{ID: "prn_ops", TenantID: root.ID, Root: true, Grants: authz.Admin}
	f := &fixture{db: db, ended: make(chan string, 16)}
	f.svc = nodes.New(nodes.Config{DB: db, EndSession: func(id string) { f.ended <- id }})
	for _, name := range []string{"acme", "globex"} {
		tn, err := ten.CreateTenant(ctx, ops, name)
		errstest.Must(t, err)
		p := authz.Principal{ID: "prn_" + name, TenantID: tn.ID, Grants: authz.Admin}
		site, err := ten.CreateSite(ctx, p, tn.ID, "lab", "")
		errstest.Must(t, err)
		pool := func(name, agent string) store.Pool {
			pl, err := ten.CreatePool(ctx, p, tn.ID, site.ID, name, agent, tenancy.Policy{})
			errstest.Must(t, err)
			return pl
		}
		if name == "acme" {
			f.acme, f.admin = tn.ID, p
			f.gpu, f.cpu, f.ipmi = pool("gpu", "bcd"), pool("cpu", "bcd"), pool("bmc", "ipmi")
		} else {
			f.globex, f.globAdm = tn.ID, p
			f.glob = pool("gpu", "bcd")
		}
	}
	return f
}

// joined stores a node of pool as a join leaves it: active at identity
// generation 1, with a certificate and a queued command.
func (f *fixture) joined(t *testing.T, pool store.Pool) (store.Node, string, string) {
	t.Helper()
	ctx := context.Background()
	now := time.Now()
	n := store.Node{ID: ids.New(ids.Node, now), TenantID: pool.OwnerTenantID, SiteID: pool.SiteID, PoolID: pool.ID, Role: "node",
		State: store.NodeAdopted, IdentityGeneration: 1, NodeKey: "unattested", Attestor: "join-token", Claims: []byte(`{}`)}
	serial := ids.New("serial", now)
	cmd := ids.New(ids.Command, now)
	errstest.Must(t, f.db.WithTx(ctx, func(tx *store.Tx) error {
		var err error
		if n, err = tx.InsertNode(ctx, n); err != nil {
			return err
		}
		if err := tx.InsertNodeCert(ctx, store.NodeCert{Serial: serial, NodeID: n.ID, IdentityGeneration: 1, Role: "node", SPKISHA256: []byte(serial),
			DER: []byte(serial), AllowedKinds: []byte(`[]`), Statements: []byte(`[]`), NotBefore: now, NotAfter: now.Add(time.Hour)}); err != nil {
			return err
		}
		return tx.InsertCommand(ctx, store.Command{ID: cmd, NodeID: n.ID, IdentityGeneration: 1, Kind: "exec", CreatedAt: now, ExpiresAt: now.Add(time.Hour)})
	}))
	return n, serial, cmd
}

// events counts tenant's events of type typ.
func (f *fixture) events(t *testing.T, tenant, typ string) int {
	t.Helper()
	ctx := context.Background()
	errstest.Must(t, f.db.WaitEventsVisible(ctx, tenant, 10*time.Second))
	n := 0
	errstest.Must(t, f.db.ReadTx(ctx, func(tx *store.Tx) error {
		evs, err := tx.ListEvents(ctx, tenant, 0, 0, typ, 1000)
		for _, e := range evs {
			if e.Type == typ {
				n++
			}
		}
		return err
	}))
	return n
}

// grants is a principal of acme holding only gs.
func (f *fixture) grants(gs ...authz.Grant) authz.Principal {
	return authz.Principal{ID: "prn_narrow", TenantID: f.acme, Grants: gs}
}

// sessionEnded waits for the next node whose session Retire ended.
func (f *fixture) sessionEnded(t *testing.T) string {
	t.Helper()
	select {
	case id := <-f.ended:
		return id
	case <-time.After(10 * time.Second):
		t.Fatal("no session ended")
		return ""
	}
}
