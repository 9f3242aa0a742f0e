package engine_test

import (
	"context"
	"errors"
	"path/filepath"
	"sync"
	"testing"
	"testing/fstest"

	"github.com/better-compute/better-compute/internal/controlplane/store/engine"
)

// schema is the least the engine runs on: the clock compute_now() reads
// and a table of the test's own.
var schema = fstest.MapFS{
	"sqlite/00001_clock.sql": {Data: []byte(`-- +goose Up
CREATE TABLE compute_clock (id INTEGER PRIMARY KEY CHECK (id = 1), offset_ms INTEGER NOT NULL DEFAULT 0);
INSERT INTO compute_clock (id, offset_ms) VALUES (1, 0);
CREATE TABLE items (id INTEGER PRIMARY KEY, at_ms INTEGER NOT NULL);
-- +goose Down
DROP TABLE items;
DROP TABLE compute_clock;
`)},
}

func openSQLite(t *testing.T) *engine.DB {
	t.Helper()
	db, err := engine.Open(context.Background(), engine.Config{Path: filepath.Join(t.TempDir(), "e.db"), Migrations: schema}, nil)
	if err != nil {
		t.Fatalf("open: %v", err)
	}
	t.Cleanup(func() { db.Close() })
	return db
}

func insert(ctx context.Context, id int) func(*engine.Tx) error {
	return func(tx *engine.Tx) error {
		_, err := tx.Exec(ctx, "INSERT INTO items (id, at_ms) VALUES (?, compute_now())", id)
		return err
	}
}

// A write begun after Close is told the database is closed (unreachable,
// so the caller's retry goes elsewhere); writes racing Close either commit
// or get that error, and none panics or waits forever.
func TestWriteAfterClose(t *testing.T) {
	ctx := context.Background()
	db := openSQLite(t)
	if err := db.WithTx(ctx, insert(ctx, 1)); err != nil {
		t.Fatalf("write before Close: %v", err)
	}
	var wg sync.WaitGroup
	errc := make(chan error, 50)
	for i := range 50 {
		wg.Go(func() { errc <- db.WithTx(ctx, insert(ctx, 100+i)) })
	}
	if err := db.Close(); err != nil {
		t.Fatalf("close: %v", err)
	}
	wg.Wait()
	close(errc)
	for err := range errc {
		if err != nil && engine.UnavailableReason(err) != engine.UnavailableUnreachable {
			t.Errorf("write racing Close: %v, want nil or unreachable", err)
		}
	}
	err := db.WithTx(ctx, insert(ctx, 2))
	if !errors.Is(err, engine.ErrClosed) || engine.UnavailableReason(err) != engine.UnavailableUnreachable {
		t.Fatalf("write after Close: %v, want ErrClosed, unreachable", err)
	}
}

// A statement's ? placeholders and compute_now() run on SQLite as written
// once; rows read back through the engine's Row and Rows.
func TestStatementsRoundTrip(t *testing.T) {
	ctx := context.Background()
	db := openSQLite(t)
	for id := 1; id <= 3; id++ {
		if err := db.WithTx(ctx, insert(ctx, id)); err != nil {
			t.Fatal(err)
		}
	}
	check := func(tx *engine.Tx) error {
		var n int64
		if err := tx.QueryRow(ctx, "SELECT COUNT(*) FROM items WHERE at_ms <= compute_now()").Scan(&n); err != nil {
			return err
		}
		if n != 3 {
			t.Errorf("count = %d, want 3", n)
		}
		rows, err := tx.Query(ctx, "SELECT id FROM items WHERE id > ? ORDER BY id", 1)
		if err != nil {
			return err
		}
		defer rows.Close()
		var ids []int64
		for rows.Next() {
			var id int64
			if err := rows.Scan(&id); err != nil {
				return err
			}
			ids = append(ids, id)
		}
		if len(ids) != 2 || ids[0] != 2 || ids[1] != 3 {
			t.Errorf("ids = %v, want [2 3]", ids)
		}
		return rows.Err()
	}
	// The writer's path (a write transaction) and the readers'.
	if err := db.WithTx(ctx, check); err != nil {
		t.Fatal(err)
	}
	if err := db.ReadTx(ctx, check); err != nil {
		t.Fatal(err)
	}
}
