package controller_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/checks/poll"
	"github.com/better-compute/better-compute/internal/controlplane/controller"
	"github.com/better-compute/better-compute/internal/controlplane/join"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
	"github.com/better-compute/better-compute/internal/shared/clock"
)

// adoptingNode stores an adopting node and queues its adoption without
// waking anyone.
func adoptingNode(t *testing.T, db *store.DB) string {
	t.Helper()
	n := storetest.Node(t, db, store.NodeAdopting)
	if err := db.WithTx(context.Background(), func(tx *store.Tx) error { return tx.EnqueueWork(context.Background(), join.WorkAdopt, n.ID) }); err != nil {
		t.Fatal(err)
	}
	return n.ID
}

// R4.5, R12.2: work nobody woke the controller for is found by its poll,
// which runs on the injected clock: moving the clock one poll interval
// adopts the node, with its event and audit row.
func TestPollRunsOnTheClock(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
		defer cancel()
		c := clock.NewFake(time.Now())
		ctrl := controller.New(controller.Config{DB: db, Clock: c, Poll: time.Minute})
		// The first pass runs at once over an empty queue; the poll's
		// ticker is armed after it.
		done := make(chan struct{})
		go func() { ctrl.Run(ctx); close(done) }()
		defer func() { cancel(); <-done }()
		if err := c.WaitArmed(ctx, 1); err != nil {
			t.Fatal(err)
		}
		// Queued with nobody woken: only the poll can find it.
		nodeID := adoptingNode(t, db)
		c.Advance(time.Minute)
		var n store.Node
		poll.UntilDetail(t, 10*time.Second, func() string { return fmt.Sprintf("the node adopted after one poll interval (state %s)", n.State) }, func() bool {
			if err := db.ReadTx(ctx, func(tx *store.Tx) error {
				var err error
				n, err = tx.GetNode(ctx, nodeID)
				return err
			}); err != nil {
				t.Fatal(err)
			}
			return n.State == store.NodeAdopted
		})
	})
}

// R4.9: join answers kept past their retention are deleted by the
// controller's poll (outside any join's transaction); live ones stay.
func TestPollPrunesExpiredJoinAnswers(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
		defer cancel()
		must := func(err error) {
			t.Helper()
			if err != nil {
				t.Fatal(err)
			}
		}
		must(db.WithTx(ctx, func(tx *store.Tx) error {
			if err := tx.InsertJoinAnswer(ctx, store.JoinAnswer{RequestDigest: []byte("expired-digest-000000000000000000"), NodeID: "node_x", Response: []byte("a"), TTL: time.Minute}); err != nil {
				return err
			}
			return tx.InsertJoinAnswer(ctx, store.JoinAnswer{RequestDigest: []byte("live-digest-00000000000000000000"), NodeID: "node_y", Response: []byte("b"), TTL: 24 * time.Hour})
		}))
		must(db.SetClockOffset(ctx, 2*time.Minute))
		defer func() { _ = db.SetClockOffset(context.Background(), 0) }()
		c := clock.NewFake(time.Now())
		ctrl := controller.New(controller.Config{DB: db, Clock: c, Poll: time.Minute})
		done := make(chan struct{})
		go func() { ctrl.Run(ctx); close(done) }()
		defer func() { cancel(); <-done }()
		must(c.WaitArmed(ctx, 1))
		c.Advance(time.Minute)
		// GetJoinAnswer hides the expired one already; the row count says
		// whether it was deleted.
		waitRows(t, db, "join answers (the live one only)", (*store.Tx).CountJoinAnswers, 1)
	})
}

// R13.2: renewal proofs are deleted by the controller's poll once they are
// a minute past their window on its clock (renewals no longer delete
// them); live ones, and ones expired more recently, stay.
func TestPollPrunesExpiredRenewProofs(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
		defer cancel()
		must := func(err error) {
			t.Helper()
			if err != nil {
				t.Fatal(err)
			}
		}
		c := clock.NewFake(time.Now())
		t0 := c.Now()
		// After the advance below the controller's clock reads t0+1m:
		// "old" expired at t0-2m, "recent" at t0+30s (within the grace),
		// "live" at t0+2m.
		must(db.WithTx(ctx, func(tx *store.Tx) error {
			for _, p := range []struct {
				proof string
				used  time.Duration
			}{{"old", -4 * time.Minute}, {"recent", -90 * time.Second}, {"live", 0}} {
				if _, err := tx.UseRenewProof(ctx, []byte(p.proof), "node_x", t0.Add(p.used), join.RenewProofWindow); err != nil {
					return err
				}
			}
			return nil
		}))
		ctrl := controller.New(controller.Config{DB: db, Clock: c, Poll: time.Minute})
		done := make(chan struct{})
		go func() { ctrl.Run(ctx); close(done) }()
		defer func() { cancel(); <-done }()
		must(c.WaitArmed(ctx, 1))
		c.Advance(time.Minute)
		waitRows(t, db, "renew proofs", (*store.Tx).CountRenewProofs, 2)
		// The two left are "recent" and "live": both still refuse a replay
		// at t0 (as the renewal of its time would see them).
		must(db.WithTx(ctx, func(tx *store.Tx) error {
			for _, p := range []string{"recent", "live"} {
				if fresh, err := tx.UseRenewProof(ctx, []byte(p), "node_x", t0, join.RenewProofWindow); err != nil || fresh {
					t.Errorf("proof %s after the prune: fresh %v, err %v; want a replay", p, fresh, err)
				}
			}
			return nil
		}))
	})
}

// waitRows polls count until it reports want rows (10 s at most).
func waitRows(t *testing.T, db *store.DB, what string, count func(*store.Tx, context.Context) (int, error), want int) {
	t.Helper()
	left := 0
	poll.UntilDetail(t, 10*time.Second, func() string { return fmt.Sprintf("%s: %d left, want %d", what, left, want) }, func() bool {
		err := db.ReadTx(context.Background(), func(tx *store.Tx) error {
			var err error
			left, err = count(tx, context.Background())
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
		return left == want
	})
}
