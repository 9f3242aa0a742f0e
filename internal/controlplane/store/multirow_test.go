package store_test

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
)

// R14.1, R14.2: events and audit rows written several at a time (more than
// one multi-row statement carries) are stored in the order given, with
// ascending ids, readable as one transaction's; a transaction that fails
// after writing them leaves none.
func TestInsertManyInOrderR14_1(t *testing.T) {
	const n = 130 // three statements of at most 64 rows
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		ctx := context.Background()
		evs := make([]store.EventRow, n)
		ents := make([]store.AuditEntry, n)
		for i := range n {
			evs[i] = store.EventRow{TenantID: "t_many", Type: "test.event", Subject: fmt.Sprintf("s%03d", i), Data: fmt.Appendf(nil, `{"i":%d}`, i)}
			ents[i] = store.AuditEntry{TenantID: "t_many", Actor: "test", Action: "test.action", Resource: fmt.Sprintf("r%03d", i), Data: fmt.Appendf(nil, `{"i":%d}`, i)}
		}
		if err := db.WithTx(ctx, func(tx *store.Tx) error {
			if err := tx.InsertEvents(ctx, evs...); err != nil {
				return err
			}
			return tx.InsertAudits(ctx, ents...)
		}); err != nil {
			t.Fatal(err)
		}
		// Rolled back: none of these are stored.
		boom := errors.New("boom")
		if err := db.WithTx(ctx, func(tx *store.Tx) error {
			if err := tx.InsertEvents(ctx, evs[:70]...); err != nil {
				return err
			}
			if err := tx.InsertAudits(ctx, ents[:70]...); err != nil {
				return err
			}
			return boom
		}); !errors.Is(err, boom) {
			t.Fatalf("got %v, want the transaction's own error", err)
		}
		if err := db.SequenceEvents(ctx); err != nil {
			t.Fatal(err)
		}
		var got []store.Event
		var audit []store.AuditEntry
		if err := db.ReadTx(ctx, func(tx *store.Tx) error {
			var err error
			if got, err = tx.ListEvents(ctx, "t_many", 0, 0, "", 1000); err != nil {
				return err
			}
			audit, err = tx.ListAudit(ctx, "t_many", 0, 1000)
			return err
		}); err != nil {
			t.Fatal(err)
		}
		if len(got) != n || len(audit) != n {
			t.Fatalf("got %d events and %d audit rows, want %d of each", len(got), len(audit), n)
		}
		for i, e := range got {
			if e.Subject != evs[i].Subject || string(e.Data) != string(evs[i].Data) || e.Type != "test.event" {
				t.Fatalf("event %d: %s %s %s, want %s %s", i, e.Type, e.Subject, e.Data, evs[i].Subject, evs[i].Data)
			}
			if i > 0 && (e.ID <= got[i-1].ID || e.TxOrder != got[0].TxOrder) {
				t.Fatalf("event %d: id %d tx_order %d after id %d tx_order %d: not one transaction's, in order", i, e.ID, e.TxOrder, got[i-1].ID, got[i-1].TxOrder)
			}
		}
		for i, a := range audit { // newest first
			want := ents[n-1-i]
			if a.Resource != want.Resource || string(a.Data) != string(want.Data) || a.Actor != "test" || a.Action != "test.action" {
				t.Fatalf("audit row %d: %s %s %s %s, want %s %s", i, a.Actor, a.Action, a.Resource, a.Data, want.Resource, want.Data)
			}
			if i > 0 && a.ID >= audit[i-1].ID {
				t.Fatalf("audit row %d: id %d not below %d", i, a.ID, audit[i-1].ID)
			}
		}
	})
}
