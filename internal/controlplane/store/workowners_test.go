package store_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
)

// one owner per work item. A live owner's items are nobody
// else's; once its lease expired on the database's clock another owner
// takes them at once (not when their one-minute claim ends), and the first
// owner can no longer finish or fail them.
func TestWorkOwnersLeaseMoves(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		ctx := context.Background()
		n := storetest.Node(t, db, store.NodeAdopting)
		must := func(err error) {
			t.Helper()
			if err != nil {
				t.Fatal(err)
			}
		}
		claim := func(owner string) []store.WorkItem {
			t.Helper()
			var items []store.WorkItem
			must(db.WithTx(ctx, func(tx *store.Tx) error {
				if err := tx.RenewWorkOwner(ctx, owner, 3*time.Second); err != nil {
					return err
				}
				var err error
				items, err = tx.ClaimWorkAs(ctx, owner, 10, time.Minute)
				return err
			}))
			return items
		}
		must(db.WithTx(ctx, func(tx *store.Tx) error { return tx.EnqueueWork(ctx, "adopt", n.ID) }))
		a := claim("ctl-a")
		if len(a) != 1 || a[0].Owner != "ctl-a" {
			t.Fatalf("a claimed %+v, want the one item", a)
		}
		if b := claim("ctl-b"); len(b) != 0 {
			t.Fatalf("b claimed %+v from a live owner", b)
		}
		// An item woken while owned (a command result arrived) stays its
		// owner's.
		must(db.WithTx(ctx, func(tx *store.Tx) error { return tx.WakeNodeWork(ctx, n.ID) }))
		if b := claim("ctl-b"); len(b) != 0 {
			t.Fatalf("b claimed a woken item from a live owner: %+v", b)
		}
		// a dies: 4 s later its lease expired, the item's own claim has not.
		must(db.SetClockOffset(ctx, 4*time.Second))
		t.Cleanup(func() { _ = db.SetClockOffset(context.Background(), 0) })
		b := claim("ctl-b")
		if len(b) != 1 || b[0].ID != a[0].ID || b[0].Owner != "ctl-b" {
			t.Fatalf("b claimed %+v after a's lease expired, want a's item", b)
		}
		for name, settle := range map[string]func(*store.Tx) error{
			"finish": func(tx *store.Tx) error { return tx.FinishWork(ctx, a[0]) },
			"fail":   func(tx *store.Tx) error { return tx.FailWork(ctx, a[0], "late", time.Second) },
		} {
			if err := db.WithTx(ctx, settle); !errors.Is(err, store.ErrLeaseLost) {
				t.Errorf("a's %s after the takeover: %v, want ErrLeaseLost", name, err)
			}
		}
		// b releases it with a failure: unowned, due after the backoff.
		must(db.WithTx(ctx, func(tx *store.Tx) error { return tx.FailWork(ctx, b[0], "deferred", time.Hour) }))
		if c := claim("ctl-c"); len(c) != 0 {
			t.Fatalf("c claimed %+v before the backoff", c)
		}
		// b stops cleanly: its next item moves at once.
		must(db.WithTx(ctx, func(tx *store.Tx) error { return tx.EnqueueWork(ctx, "adopt", n.ID) }))
		if b = claim("ctl-b"); len(b) != 1 {
			t.Fatalf("b claimed %+v", b)
		}
		must(db.WithTx(ctx, func(tx *store.Tx) error { return tx.ReleaseWorkOwner(ctx, "ctl-b") }))
		c := claim("ctl-c")
		if len(c) != 1 || c[0].ID != b[0].ID {
			t.Fatalf("c claimed %+v after b released, want b's item", c)
		}
		must(db.WithTx(ctx, func(tx *store.Tx) error { return tx.FinishWork(ctx, c[0]) }))
	})
}
