package controller_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/controlplane/controller"
	"github.com/better-compute/better-compute/internal/controlplane/session"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
	"github.com/better-compute/better-compute/internal/shared/clock"
	"github.com/better-compute/better-compute/internal/shared/ids"
	"github.com/better-compute/better-compute/internal/shared/wire"
)

// fleet is one tenant with a pool running acceptance checks and one
// connected node waiting for them.
type fleet struct {
	db     *store.DB
	clk    *clock.Fake
	ctrl   *controller.Controller
	tenant string
	node   string
}

func newFleet(t *testing.T, db *store.DB) *fleet {
	t.Helper()
	ctx := context.Background()
	clk := clock.NewFake(time.Now())
	now := clk.Now()
	f := &fleet{db: db, clk: clk, ctrl: controller.New(controller.Config{DB: db, Clock: clk}),
		tenant: ids.New(ids.Tenant, now), node: ids.New(ids.Node, now)}
	site, pool := ids.New(ids.Site, now), ids.New(ids.Pool, now)
	must(t, db.WithTx(ctx, func(tx *store.Tx) error {
		if _, err := tx.InsertTenant(ctx, f.tenant, "acme-"+f.tenant); err != nil {
			return err
		}
		if _, err := tx.InsertSite(ctx, store.Site{ID: site, OwnerTenantID: f.tenant, Name: "dc", Custom: true}); err != nil {
			return err
		}
		if _, err := tx.InsertPool(ctx, store.Pool{ID: pool, SiteID: site, OwnerTenantID: f.tenant, Name: "gpu", Agent: "bcd",
			Policy: []byte(`{"acceptance":{"minCpus":2}}`)}); err != nil {
			return err
		}
		if _, err := tx.InsertNode(ctx, store.Node{ID: f.node, TenantID: f.tenant, SiteID: site, PoolID: pool, Role: "node",
			State: store.NodeAdopting, IdentityGeneration: 1, NodeKey: "unattested", Attestor: "join-token", Claims: []byte(`{}`)}); err != nil {
			return err
		}
		if _, err := tx.ConnectNode(ctx, f.node, "sess-1"); err != nil {
			return err
		}
		return tx.EnqueueWork(ctx, session.WorkAccept, f.node)
	}))
	return f
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// run makes the node's work due now and processes the queue once.
func (f *fleet) run(t *testing.T) {
	t.Helper()
	ctx := context.Background()
	must(t, f.db.WithTx(ctx, func(tx *store.Tx) error { return tx.WakeNodeWork(ctx, f.node) }))
	if n, err := f.ctrl.RunOnce(ctx); err != nil || n != 1 {
		t.Fatalf("RunOnce = %d, %v; want 1 item", n, err)
	}
}

func (f *fleet) latest(t *testing.T) store.Command {
	t.Helper()
	var c store.Command
	must(t, f.db.ReadTx(context.Background(), func(tx *store.Tx) error {
		var err error
		c, err = tx.LatestCommand(context.Background(), f.node, wire.KindAcceptanceCheck)
		return err
	}))
	return c
}

func (f *fleet) answer(t *testing.T, id string, result any) {
	t.Helper()
	ctx := context.Background()
	b, _ := json.Marshal(result)
	must(t, f.db.WithTx(ctx, func(tx *store.Tx) error {
		if _, err := tx.MarkCommandSent(ctx, id); err != nil {
			return err
		}
		_, err := tx.FinishCommand(ctx, id, store.CommandDone, b, "")
		return err
	}))
}

// audit returns the tenant's audit rows of action, with their data.
func (f *fleet) audit(t *testing.T, action string) []map[string]any {
	t.Helper()
	var rows []store.AuditEntry
	must(t, f.db.ReadTx(context.Background(), func(tx *store.Tx) error {
		var err error
		rows, err = tx.ListAuditAfter(context.Background(), f.tenant, 0, 1000)
		return err
	}))
	var out []map[string]any
	for _, r := range rows {
		if r.Action != action {
			continue
		}
		if r.Actor != "controller" || r.Resource != "compute-node/"+f.node || r.CreatedAt.IsZero() {
			t.Fatalf("%s row by %q on %q at %v", action, r.Actor, r.Resource, r.CreatedAt)
		}
		var d map[string]any
		must(t, json.Unmarshal(r.Data, &d))
		out = append(out, d)
	}
	return out
}

// R14.2: the controller's acceptance writes an audit row
// (who, what, when, on what) for each change it makes: the acceptance.check
// it sends, its expiry, and the result.
func TestAcceptanceAudit(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		t.Run("sent, expired, sent again, passed", func(t *testing.T) {
			f := newFleet(t, db)
			f.run(t)
			first := f.latest(t)
			if first.State != store.CommandQueued {
				t.Fatalf("first acceptance.check %s", first.State)
			}
			if rows := f.audit(t, "command.enqueued"); len(rows) != 1 || rows[0]["commandId"] != first.ID || rows[0]["kind"] != wire.KindAcceptanceCheck {
				t.Fatalf("command.enqueued rows %v, want one for %s", rows, first.ID)
			}

			// Nobody answers: past its expiry, the controller expires it
			// and sends another.
			f.clk.Advance(6 * time.Minute)
			f.run(t)
			second := f.latest(t)
			var expired store.Command
			must(t, db.ReadTx(context.Background(), func(tx *store.Tx) error {
				var err error
				expired, err = tx.GetCommand(context.Background(), first.ID)
				return err
			}))
			if expired.State != store.CommandExpired || second.ID == first.ID {
				t.Fatalf("first %s, latest %s", expired.State, second.ID)
			}
			rows := f.audit(t, "command.expired")
			if len(rows) != 1 || rows[0]["commandId"] != first.ID || rows[0]["previousState"] != store.CommandQueued || rows[0]["reason"] != "expired before delivery" {
				t.Fatalf("command.expired rows %v, want one for %s", rows, first.ID)
			}
			if rows := f.audit(t, "command.enqueued"); len(rows) != 2 || rows[1]["commandId"] != second.ID {
				t.Fatalf("command.enqueued rows %v", rows)
			}

			f.answer(t, second.ID, controller.AcceptanceResult{Pass: true, Checks: []controller.AcceptanceCheck{{Name: "minCpus", Want: 2, Have: 4, Pass: true}}})
			f.run(t)
			passed := f.audit(t, "node.acceptance-passed")
			if len(passed) != 1 || passed[0]["commandId"] != second.ID || passed[0]["nodeId"] != f.node {
				t.Fatalf("node.acceptance-passed rows %v", passed)
			}
			if checks, _ := passed[0]["checks"].([]any); len(checks) != 1 {
				t.Fatalf("checks %v", passed[0]["checks"])
			}
			if rows := f.audit(t, "node.adopted"); len(rows) != 1 {
				t.Fatalf("node.adopted rows %v", rows)
			}
		})
		t.Run("failed", func(t *testing.T) {
			f := newFleet(t, db)
			f.run(t)
			cmd := f.latest(t)
			f.answer(t, cmd.ID, controller.AcceptanceResult{Checks: []controller.AcceptanceCheck{{Name: "minCpus", Want: 2, Have: 1}}})
			f.run(t)
			rows := f.audit(t, "node.acceptance-failed")
			if len(rows) != 1 || rows[0]["commandId"] != cmd.ID || rows[0]["reason"] != "minCpus: want at least 2, have 1" {
				t.Fatalf("node.acceptance-failed rows %v", rows)
			}
			if rows := f.audit(t, "node.acceptance-passed"); len(rows) != 0 {
				t.Fatalf("passed rows for a failed node: %v", rows)
			}
		})
	})
}
