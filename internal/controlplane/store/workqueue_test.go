package store_test

import (
	"context"
	"testing"

	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
)

// R4.5, R12.2: the controller is woken by work being queued or made due,
// once per receive however many commits queued it, and only after the
// commit: a transaction that rolled back wakes nobody.
func TestWorkQueuedWakesR4_5(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		ctx := context.Background()
		n := storetest.Node(t, db, store.NodeAdopting)
		pending := func() bool {
			select {
			case <-db.WorkQueued():
				return true
			default:
				return false
			}
		}
		pending() // storetest.Node queues nothing; drain to be sure
		for _, tc := range []struct {
			name string
			fn   func(tx *store.Tx) error
			want bool
		}{
			{"a rolled-back enqueue", func(tx *store.Tx) error {
				if err := tx.EnqueueWork(ctx, "accept", n.ID); err != nil {
					return err
				}
				return context.Canceled
			}, false},
			{"enqueue", func(tx *store.Tx) error { return tx.EnqueueWork(ctx, "accept", n.ID) }, true},
			{"enqueue once, already queued", func(tx *store.Tx) error { _, err := tx.EnqueueWorkOnce(ctx, "accept", n.ID); return err }, true},
			{"wake the node's work", func(tx *store.Tx) error { return tx.WakeNodeWork(ctx, n.ID) }, true},
			{"wake a node without work", func(tx *store.Tx) error { return tx.WakeNodeWork(ctx, "node_none") }, false},
		} {
			_ = db.WithTx(ctx, tc.fn)
			if got := pending(); got != tc.want {
				t.Errorf("%s: woken %v, want %v", tc.name, got, tc.want)
			}
		}
		// Two commits, one receive.
		for range 2 {
			if err := db.WithTx(ctx, func(tx *store.Tx) error { return tx.EnqueueWork(ctx, "accept", n.ID) }); err != nil {
				t.Fatal(err)
			}
		}
		if !pending() || pending() {
			t.Error("two enqueues: want exactly one wake-up")
		}
	})
}
