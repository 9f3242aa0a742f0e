package store_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/checks/poll"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
)

func useProof(t *testing.T, db *store.DB, proof string, now time.Time) bool {
	t.Helper()
	return mustTx(t, db, func(tx *store.Tx) (bool, error) {
		return tx.UseRenewProof(context.Background(), digestOf(proof), "node_x", now, 2*time.Minute)
	})
}

func countProofs(t *testing.T, db *store.DB) int {
	t.Helper()
	return mustTx(t, db, func(tx *store.Tx) (int, error) { return tx.CountRenewProofs(context.Background()) })
}

// R13.2: a proof is fresh once and a replay while its record lives; once
// the record expired the proof is fresh again whether or not the expired
// row was deleted (renewals no longer prune, the controller does), and
// using it again records a new window.
func TestRenewProofsR13_2(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		t0 := time.UnixMilli(time.Now().UnixMilli())
		if !useProof(t, db, "p1", t0) {
			t.Fatal("first use of a proof is not fresh")
		}
		for _, at := range []time.Duration{0, time.Second, 2*time.Minute - time.Millisecond} {
			if useProof(t, db, "p1", t0.Add(at)) {
				t.Fatalf("proof fresh again %v after its first use, within its window", at)
			}
		}
		if !useProof(t, db, "p2", t0) {
			t.Fatal("another proof is not fresh")
		}
		// Expired, still stored: fresh, in place.
		t1 := t0.Add(2 * time.Minute)
		if !useProof(t, db, "p1", t1) {
			t.Fatal("proof not fresh once its record expired")
		}
		if n := countProofs(t, db); n != 2 {
			t.Fatalf("%d proof rows, want 2", n)
		}
		if useProof(t, db, "p1", t1.Add(time.Minute)) {
			t.Fatal("proof fresh within the window of its second use")
		}
	})
}

// R13.2: DeleteExpiredRenewProofs deletes expired proofs only, oldest
// first, in batches, and never a live one.
func TestDeleteExpiredRenewProofs(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		ctx := context.Background()
		t0 := time.UnixMilli(time.Now().UnixMilli())
		for i, p := range []string{"a", "b", "c", "d"} {
			useProof(t, db, p, t0.Add(time.Duration(i)*time.Second)) // expire at t0+2m+i s
		}
		del := func(before time.Time, limit int) int {
			t.Helper()
			return mustTx(t, db, func(tx *store.Tx) (int, error) { return tx.DeleteExpiredRenewProofs(ctx, before, limit) })
		}
		if n := del(t0.Add(2*time.Minute-time.Millisecond), 10); n != 0 {
			t.Fatalf("deleted %d live proofs", n)
		}
		// Three expired by t0+2m+2s, two per batch: oldest first.
		before := t0.Add(2*time.Minute + 2*time.Second)
		if n := del(before, 2); n != 2 {
			t.Fatalf("first batch deleted %d, want 2", n)
		}
		if useProof(t, db, "c", t0.Add(time.Minute)) {
			t.Fatal("the youngest expired proof went before the older ones")
		}
		if n := del(before, 2); n != 1 {
			t.Fatalf("second batch deleted %d, want 1", n)
		}
		if n := countProofs(t, db); n != 1 {
			t.Fatalf("%d proofs left, want the live one", n)
		}
		if useProof(t, db, "d", t0.Add(time.Minute)) {
			t.Fatal("the live proof was deleted")
		}
		if n := del(before, 0); n != 0 {
			t.Fatalf("a batch of 0 deleted %d", n)
		}
	})
}

// R13.2, several replicas: renewals racing with one proof get one fresh
// answer, also when they replace an expired record; and a prune racing
// with a renewal that refreshes an expired record keeps the refreshed row
// (on PostgreSQL the delete waits for the renewal's row and re-checks its
// expiry), so a replay of that proof stays refused.
func TestRenewProofRacesR13_2(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		ctx := context.Background()
		t0 := time.UnixMilli(time.Now().UnixMilli())
		useProof(t, db, "raced", t0)
		t1 := t0.Add(3 * time.Minute)
		var fresh atomic.Int64
		var wg sync.WaitGroup
		for range 8 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				ok, err := withTx(t, db, func(tx *store.Tx) (bool, error) {
					return tx.UseRenewProof(ctx, digestOf("raced"), "node_x", t1, 2*time.Minute)
				})
				if err != nil {
					t.Error(err)
				}
				if ok {
					fresh.Add(1)
				}
			}()
		}
		wg.Wait()
		if n := fresh.Load(); n != 1 {
			t.Fatalf("%d racing uses of an expired proof were fresh, want 1", n)
		}

		// Refresh an expired record and hold the transaction open while a
		// prune that picked it runs.
		useProof(t, db, "held", t0)
		held, release := make(chan struct{}), make(chan struct{})
		errc := make(chan error, 1)
		go func() {
			errc <- db.WithTx(ctx, func(tx *store.Tx) error {
				ok, err := tx.UseRenewProof(ctx, digestOf("held"), "node_x", t1, 2*time.Minute)
				if err == nil && !ok {
					t.Error("refreshing an expired proof was not fresh")
				}
				close(held)
				<-release
				return err
			})
		}()
		<-held
		pruned := make(chan int, 1)
		go func() {
			n, err := withTx(t, db, func(tx *store.Tx) (int, error) { return tx.DeleteExpiredRenewProofs(ctx, t1, 10) })
			if err != nil {
				t.Error(err)
			}
			pruned <- n
		}()
		waitPruneBlocked(t, db)
		close(release)
		if err := <-errc; err != nil {
			t.Fatal(err)
		}
		<-pruned
		if useProof(t, db, "held", t1.Add(time.Second)) {
			t.Fatal("the prune deleted a proof refreshed while it ran: its replay was fresh")
		}
	})
}

// waitPruneBlocked waits until a DELETE of renew proofs waits behind the
// held transaction: on SQLite queued for the writer, on PostgreSQL blocked
// on a lock (pg_stat_activity shows what each backend waits on).
func waitPruneBlocked(t *testing.T, db *store.DB) {
	t.Helper()
	if db.Dialect() == store.SQLite {
		waitQueued(t, db, 1)
		return
	}
	ctx := context.Background()
	poll.Until(t, 10*time.Second, "the prune to wait for the held row's lock", func() bool {
		var n int64
		err := db.ReadTx(ctx, func(tx *store.Tx) error {
			var err error
			n, err = tx.QueryInt(ctx, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()
				AND wait_event_type = 'Lock' AND query LIKE 'DELETE FROM renew_proofs%'`)
			return err
		})
		if err != nil {
			t.Fatalf("read pg_stat_activity: %v", err)
		}
		return n > 0
	})
}
