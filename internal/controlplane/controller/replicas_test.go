package controller_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/checks/poll"
	"github.com/better-compute/better-compute/internal/controlplane/controller"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
	"github.com/better-compute/better-compute/internal/shared/clock"
)

// eachReplicaPair runs fn with two store handles on one database, as two
// API replicas have: the same SQLite handle, or two PostgreSQL pools.
func eachReplicaPair(t *testing.T, fn func(t *testing.T, a, b *store.DB)) {
	t.Run("sqlite", func(t *testing.T) { db := storetest.OpenSQLite(t); fn(t, db, db) })
	t.Run("postgres", func(t *testing.T) { dbs := storetest.PostgresReplicas(t, 2); fn(t, dbs[0], dbs[1]) })
}

func nodeState(t *testing.T, db *store.DB, id string) string {
	t.Helper()
	var n store.Node
	must(t, db.ReadTx(context.Background(), func(tx *store.Tx) error {
		var err error
		n, err = tx.GetNode(context.Background(), id)
		return err
	}))
	return n.State
}

// R4.5: a replica's controller claims five adoptions and is
// killed before it processes them. The other replica's controller leaves
// them alone while the dead one's lease (3 s on the database's clock) is
// live, and adopts all five at its first poll after the lease expired, not
// a minute later.
func TestLeaseMovesFromDeadReplica(t *testing.T) {
	eachReplicaPair(t, func(t *testing.T, dbA, dbB *store.DB) {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		var nodes []string
		for range 5 {
			nodes = append(nodes, adoptingNode(t, dbA))
		}
		a := controller.New(controller.Config{DB: dbA, Clock: clock.NewFake(time.Now()), ID: "ctl-a"})
		claimed, err := a.Claim(ctx)
		if err != nil || len(claimed) != 5 {
			t.Fatalf("a claimed %d items (%v), want 5", len(claimed), err)
		}
		// a is killed now: no release, no renewal.

		clk := clock.NewFake(time.Now())
		b := controller.New(controller.Config{DB: dbB, Clock: clk, ID: "ctl-b", Poll: time.Second})
		done := make(chan struct{})
		go func() { b.Run(ctx); close(done) }()
		defer func() { cancel(); <-done }()
		must(t, clk.WaitArmed(ctx, 1)) // b's first pass is over
		for _, id := range nodes {
			if s := nodeState(t, dbB, id); s != store.NodeAdopting {
				t.Fatalf("b moved node %s to %s while a's lease was live", id, s)
			}
		}
		must(t, dbB.SetClockOffset(ctx, 4*time.Second))
		t.Cleanup(func() { _ = dbB.SetClockOffset(context.Background(), 0) })
		clk.Advance(time.Second)
		for _, id := range nodes {
			poll.UntilDetail(t, 10*time.Second, func() string {
				return fmt.Sprintf("node %s adopted after a's lease expired and b polled (still %s)", id, nodeState(t, dbB, id))
			}, func() bool { return nodeState(t, dbB, id) == store.NodeAdopted })
		}
	})
}

// a controller that stops cleanly releases its lease, so what it
// had claimed moves at once, with no clock moved.
func TestStoppedControllerReleasesLease(t *testing.T) {
	eachReplicaPair(t, func(t *testing.T, dbA, dbB *store.DB) {
		ctx := context.Background()
		node := adoptingNode(t, dbA)
		a := controller.New(controller.Config{DB: dbA, Clock: clock.NewFake(time.Now()), ID: "ctl-a"})
		if claimed, err := a.Claim(ctx); err != nil || len(claimed) != 1 {
			t.Fatalf("a claimed %d items (%v), want 1", len(claimed), err)
		}
		b := controller.New(controller.Config{DB: dbB, Clock: clock.NewFake(time.Now()), ID: "ctl-b"})
		if n, err := b.RunOnce(ctx); err != nil || n != 0 {
			t.Fatalf("b took %d items (%v) from a live owner", n, err)
		}
		stopped, stop := context.WithCancel(ctx)
		stop()
		a.Run(stopped) // returns at once and releases a's lease
		if n, err := b.RunOnce(ctx); err != nil || n != 1 {
			t.Fatalf("b took %d items (%v) after a stopped, want 1", n, err)
		}
		if s := nodeState(t, dbB, node); s != store.NodeAdopted {
			t.Fatalf("node %s, want adopted", s)
		}
	})
}
