package tokens_test

import (
	"context"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/controlplane/authz"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/tenancy"
	"github.com/better-compute/better-compute/internal/controlplane/tokens"
	"github.com/better-compute/better-compute/internal/shared/errs/errstest"
)

// fixture is acme with two daemon pools and one that runs no daemon, and
// globex with a pool of its own.
type fixture struct {
	db                   *store.DB
	svc                  *tokens.Service
	acme, globex         string
	admin, globAdm       authz.Principal
	gpu, cpu, ipmi, glob store.Pool
}

func newFixture(t *testing.T, db *store.DB) *fixture {
	t.Helper()
	ctx := context.Background()
	ten := tenancy.New(tenancy.Config{DB: db})
	root, _, err := ten.Bootstrap(ctx, "root")
	errstest.Must(t, err)
	ops := authz.Principal{ID: "prn_ops", TenantID: root.ID, Root: true, Grants: authz.Admin}
	f := &fixture{db: db, svc: tokens.New(tokens.Config{DB: db})}
	for _, name := range []string{"acme", "globex"} {
		tn, err := ten.CreateTenant(ctx, ops, name)
		errstest.Must(t, err)
		p := authz.Principal{ID: "prn_" + name, TenantID: tn.ID, Name: name, Grants: authz.Admin}
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

// token reads a token back as the store holds it.
func (f *fixture) token(t *testing.T, id string) store.JoinToken {
	t.Helper()
	var tok store.JoinToken
	errstest.Must(t, f.db.ReadTx(context.Background(), func(tx *store.Tx) error {
		var err error
		tok, err = tx.GetJoinToken(context.Background(), id)
		return err
	}))
	return tok
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
