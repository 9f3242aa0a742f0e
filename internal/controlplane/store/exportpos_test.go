package store_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/checks/poll"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
)

// exportReplicas are two stores on one database, as two API replicas:
// one SQLite store (its processes share the file, and one store is what a
// second process would see), two PostgreSQL pools on one schema.
func exportReplicas(t *testing.T, fn func(t *testing.T, a, b *store.DB)) {
	t.Run("sqlite", func(t *testing.T) { db := storetest.OpenSQLite(t); fn(t, db, db) })
	t.Run("postgres", func(t *testing.T) { r := storetest.PostgresReplicas(t, 2); fn(t, r[0], r[1]) })
}

// R17.4: one exporter at a time. A live lease is its holder's; once it
// expired on the database's clock the other replica takes it, and the
// first can no longer commit a position.
func TestExportLeaseMoves(t *testing.T) {
	exportReplicas(t, func(t *testing.T, a, b *store.DB) {
		ctx := context.Background()
		take := func(db *store.DB, holder string) bool {
			t.Helper()
			var ok bool
			if err := db.WithTx(ctx, func(tx *store.Tx) error {
				var err error
				ok, err = tx.TakeExportLease(ctx, store.ExportLease, holder, 10*time.Second)
				return err
			}); err != nil {
				t.Fatal(err)
			}
			return ok
		}
		commit := func(db *store.DB, holder string, p store.ExportPosition) error {
			return db.WithTx(ctx, func(tx *store.Tx) error {
				return tx.CommitExportPosition(ctx, store.ExportLease, holder, "siem", p)
			})
		}
		if !take(a, "a") || !take(a, "a") {
			t.Fatal("a could not take and renew a free lease")
		}
		if take(b, "b") {
			t.Fatal("b took a live lease")
		}
		if err := commit(b, "b", store.ExportPosition{EventID: 9}); !errors.Is(err, store.ErrExportLeaseLost) {
			t.Fatalf("b committed without the lease: %v", err)
		}
		if err := commit(a, "a", store.ExportPosition{EventOrder: 1, EventID: 2, AuditOrder: 3, AuditID: 4}); err != nil {
			t.Fatal(err)
		}
		if err := b.SetClockOffset(ctx, 11*time.Second); err != nil {
			t.Fatal(err)
		}
		if !take(b, "b") {
			t.Fatal("b could not take an expired lease")
		}
		if err := commit(a, "a", store.ExportPosition{EventID: 99}); !errors.Is(err, store.ErrExportLeaseLost) {
			t.Fatalf("a committed after its lease moved: %v", err)
		}
		var p store.ExportPosition
		if err := b.ReadTx(ctx, func(tx *store.Tx) error {
			var err error
			p, err = tx.ReadExportPosition(ctx, "siem")
			return err
		}); err != nil {
			t.Fatal(err)
		}
		if want := (store.ExportPosition{EventOrder: 1, EventID: 2, AuditOrder: 3, AuditID: 4}); p != want {
			t.Fatalf("b resumes at %+v, want a's %+v", p, want)
		}
		if err := b.WithTx(ctx, func(tx *store.Tx) error { return tx.ReleaseExportLease(ctx, store.ExportLease, "b") }); err != nil {
			t.Fatal(err)
		}
		if err := a.SetClockOffset(ctx, 0); err != nil {
			t.Fatal(err)
		}
		if !take(a, "a") {
			t.Fatal("a could not take a released lease")
		}
	})
}

// R17.4: the export reads page every tenant's rows in an order that never
// passes over a row committed later, so a position never skips one.
func TestExportReadsPage(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		ctx := context.Background()
		for i, tenant := range []string{"ten_a", "ten_b", "ten_a"} {
			if err := db.WithTx(ctx, func(tx *store.Tx) error {
				if err := tx.InsertEvent(ctx, tenant, "test.thing", "s", []byte(`{}`)); err != nil {
					return err
				}
				return tx.InsertAudit(ctx, store.AuditEntry{TenantID: tenant, Actor: "system", Action: "thing", Resource: "r", Data: []byte(`{"i":1}`)})
			}); err != nil {
				t.Fatalf("write %d: %v", i, err)
			}
		}
		if err := db.SequenceEvents(ctx); err != nil {
			t.Fatal(err)
		}
		var p store.ExportPosition
		var evs []store.Event
		var aus []store.ExportAudit
		// Polls: on PostgreSQL another test's open transaction in the
		// cluster holds audit rows back until it ends.
		poll.Until(t, 10*time.Second, "every row read", func() bool {
			err := db.ReadTx(ctx, func(tx *store.Tx) error {
				e, err := tx.ExportEvents(ctx, p.EventOrder, p.EventID, 2)
				if err != nil {
					return err
				}
				a, err := tx.ExportAuditRows(ctx, p.AuditOrder, p.AuditID, 2)
				for _, x := range e {
					p.EventOrder, p.EventID = x.TxOrder, x.ID
				}
				for _, x := range a {
					p.AuditOrder, p.AuditID = x.Order, x.ID
				}
				evs, aus = append(evs, e...), append(aus, a...)
				return err
			})
			if err != nil {
				t.Fatal(err)
			}
			return len(evs) >= 3 && len(aus) >= 3
		})
		if len(evs) != 3 || len(aus) != 3 {
			t.Fatalf("read %d events and %d audit rows, want 3 of each", len(evs), len(aus))
		}
		if evs[1].TenantID != "ten_b" || aus[1].TenantID != "ten_b" || string(aus[2].Data) != `{"i":1}` {
			t.Fatalf("read out of order: %+v %+v", evs, aus)
		}
	})
}

// R17.4: on PostgreSQL an audit row whose transaction is still open holds
// the audit export back, so a row with a lower id committing after a
// higher one was exported is never passed over.
func TestExportAuditWaitsForOpenTransactions(t *testing.T) {
	db, raw := storetest.PostgresWithRaw(t)
	ctx := context.Background()
	// A row from before migration 00020 (no writer_xid) comes first.
	if _, err := raw.ExecContext(ctx, "INSERT INTO audit (tenant_id, actor, action, resource, created_ms, writer_xid) VALUES ('ten_a', 'system', 'legacy', 'r', 0, NULL)"); err != nil {
		t.Fatal(err)
	}
	open, err := raw.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer open.Rollback()
	if _, err := open.ExecContext(ctx, "INSERT INTO audit (tenant_id, actor, action, resource, created_ms) VALUES ('ten_a', 'system', 'early', 'r', 0)"); err != nil {
		t.Fatal(err)
	}
	if err := db.WithTx(ctx, func(tx *store.Tx) error {
		return tx.InsertAudit(ctx, store.AuditEntry{TenantID: "ten_a", Actor: "system", Action: "late", Resource: "r", Data: []byte(`{}`)})
	}); err != nil {
		t.Fatal(err)
	}
	read := func() []string {
		t.Helper()
		var got []string
		if err := db.ReadTx(ctx, func(tx *store.Tx) error {
			rows, err := tx.ExportAuditRows(ctx, 0, 0, 10)
			for _, r := range rows {
				got = append(got, r.Action)
			}
			return err
		}); err != nil {
			t.Fatal(err)
		}
		return got
	}
	if got := read(); len(got) != 1 || got[0] != "legacy" {
		t.Fatalf("exported %v while an older transaction writing audit is open, want [legacy]", got)
	}
	if err := open.Commit(); err != nil {
		t.Fatal(err)
	}
	// Polls: another test's open transaction in the cluster holds the
	// rows back too, until it ends.
	var got []string
	poll.Until(t, 10*time.Second, "the rows after the commit", func() bool { got = read(); return len(got) >= 3 })
	if len(got) != 3 || got[1] != "early" || got[2] != "late" {
		t.Fatalf("exported %v after the commit, want [legacy early late]", got)
	}
}
