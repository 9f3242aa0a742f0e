package engine_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/controlplane/store/engine"
)

// readPool is the SQLite read pool's size (engine.Open).
const readPool = 8

// As many first reads as the read pool has connections, all inside their
// transactions at once (an API's restart under thousands of sessions,
// with no statement prepared yet), all end: each prepares its queries
// for the next ones after its own connection is back in the pool, not
// while it holds it and waits for another.
func TestFirstReadsFillingThePoolEnd(t *testing.T) {
	ctx := context.Background()
	db := openSQLite(t)
	var inside sync.WaitGroup
	inside.Add(readPool)
	all := make(chan struct{})
	go func() { inside.Wait(); close(all) }()
	done := make(chan error, readPool)
	for range readPool {
		go func() {
			done <- db.ReadTx(ctx, func(tx *engine.Tx) error {
				var n int64
				if err := tx.QueryRow(ctx, "SELECT COUNT(*) FROM items WHERE id >= ?", 0).Scan(&n); err != nil {
					return err
				}
				inside.Done()
				<-all // every connection of the pool is held now
				return nil
			})
		}()
	}
	deadline := time.After(30 * time.Second)
	for range readPool {
		select {
		case err := <-done:
			if err != nil {
				t.Fatal(err)
			}
		case <-deadline:
			t.Fatal("the read pool's connections wait for each other")
		}
	}
}
