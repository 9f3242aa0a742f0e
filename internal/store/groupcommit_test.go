package store_test

import (
	"context"
	"database/sql/driver"
	"errors"
	"sync"
	"testing"
	"time"

	"modernc.org/sqlite"

	"github.com/better-compute/better-compute/internal/store"
	"github.com/better-compute/better-compute/internal/store/storetest"
)

// block is the state of the test_block SQL function: the first row it sees
// (x = 1) signals entered and waits for release, so a test can act while a
// statement is running.
var block struct {
	mu      sync.Mutex
	entered chan struct{}
	release chan struct{}
}

func init() {
	sqlite.MustRegisterScalarFunction("test_block", 1, func(_ *sqlite.FunctionContext, args []driver.Value) (driver.Value, error) {
		if x, _ := args[0].(int64); x == 1 {
			block.mu.Lock()
			entered, release := block.entered, block.release
			block.mu.Unlock()
			if entered != nil {
				close(entered)
				<-release
			}
		}
		return int64(1), nil
	})
}

func armBlock(t *testing.T) (entered, release chan struct{}) {
	block.mu.Lock()
	defer block.mu.Unlock()
	block.entered, block.release = make(chan struct{}), make(chan struct{})
	t.Cleanup(func() {
		block.mu.Lock()
		block.entered, block.release = nil, nil
		block.mu.Unlock()
	})
	return block.entered, block.release
}

func scratch(t *testing.T, db *store.DB, ddl ...string) {
	t.Helper()
	ctx := context.Background()
	err := db.WithTx(ctx, func(tx *store.Tx) error {
		for _, q := range ddl {
			if err := tx.ExecRaw(ctx, q); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatalf("scratch tables: %v", err)
	}
}

// rowsOf counts the scratch rows written by who.
func rowsOf(t *testing.T, db *store.DB, who string) int64 {
	t.Helper()
	ctx := context.Background()
	var n int64
	err := db.ReadTx(ctx, func(tx *store.Tx) error {
		var err error
		n, err = tx.QueryInt(ctx, "SELECT COUNT(*) FROM gc_rows WHERE who = ?", who)
		return err
	})
	if err != nil {
		t.Fatalf("count rows of %s: %v", who, err)
	}
	return n
}

// waitQueued waits until n write transactions wait for the writer.
func waitQueued(t *testing.T, db *store.DB, n int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for db.QueuedWrites() < n {
		if time.Now().After(deadline) {
			t.Fatalf("%d writes queued, want %d", db.QueuedWrites(), n)
		}
		time.Sleep(time.Millisecond)
	}
}

func insertRow(who string) func(*store.Tx) error {
	return func(tx *store.Tx) error {
		return tx.ExecRaw(context.Background(), "INSERT INTO gc_rows (who, n) VALUES (?, 0)", who)
	}
}

// R14.1, R4.9: a participant of a shared SQLite commit whose context is
// cancelled while its statement runs fails alone. Before the fix the driver
// interrupted the statement, SQLite rolled back the whole shared
// transaction (losing B, which had succeeded), and C's statements then ran
// outside any transaction, committed, and C was told it failed.
func TestGroupCommitCancelMidStatement(t *testing.T) {
	db := storetest.OpenSQLite(t)
	ctx := context.Background()
	scratch(t, db, "CREATE TABLE gc_rows (who TEXT NOT NULL, n INTEGER NOT NULL)")
	entered, release := armBlock(t)

	// B runs first and holds the writer until A and C wait behind it, so
	// all three share one commit, in the order B, A, C.
	bIn, bGo := make(chan struct{}), make(chan struct{})
	resB, resA, resC := make(chan error, 1), make(chan error, 1), make(chan error, 1)
	go func() {
		resB <- db.WithTx(ctx, func(tx *store.Tx) error {
			if err := insertRow("B")(tx); err != nil {
				return err
			}
			close(bIn)
			<-bGo
			return nil
		})
	}()
	<-bIn
	actx, cancelA := context.WithCancel(ctx)
	defer cancelA()
	go func() {
		resA <- db.WithTx(actx, func(tx *store.Tx) error {
			// A long insert that stops at its first row until released.
			err := tx.ExecRaw(actx, `INSERT INTO gc_rows (who, n)
				SELECT 'A', x FROM (WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 100000) SELECT x FROM c)
				WHERE test_block(x) = 1`)
			if err != nil {
				return err
			}
			return tx.ExecRaw(actx, "INSERT INTO gc_rows (who, n) VALUES ('A', -1)")
		})
	}()
	waitQueued(t, db, 1)
	go func() { resC <- db.WithTx(ctx, insertRow("C")) }()
	waitQueued(t, db, 2)
	close(bGo)
	<-entered
	cancelA()
	close(release)

	if err := <-resA; !errors.Is(err, context.Canceled) {
		t.Errorf("A (cancelled mid-statement): err = %v, want context.Canceled", err)
	}
	if err := <-resB; err != nil {
		t.Errorf("B: err = %v, want committed", err)
	}
	if err := <-resC; err != nil {
		t.Errorf("C: err = %v, want committed", err)
	}
	for who, want := range map[string]int64{"A": 0, "B": 1, "C": 1} {
		if got := rowsOf(t, db, who); got != want {
			t.Errorf("rows of %s = %d, want %d", who, got, want)
		}
	}
	// The writer goes on.
	if err := db.WithTx(ctx, insertRow("D")); err != nil || rowsOf(t, db, "D") != 1 {
		t.Fatalf("write after the batch: %v", err)
	}
}
