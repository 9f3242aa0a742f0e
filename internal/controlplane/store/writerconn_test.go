package store_test

import (
	"context"
	"runtime"
	"strings"
	"testing"

	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
)

// rowWatchers counts the goroutines database/sql started to watch a
// query's context (Rows.awaitDone).
func rowWatchers() int {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			return strings.Count(string(buf[:n]), "database/sql.(*Rows).awaitDone")
		}
		buf = make([]byte, 2*len(buf))
	}
}

// R14.1: a statement of SQLite's shared transaction runs on no context
// that can end, so the driver never interrupts it (which would roll back
// every participant) and database/sql starts no goroutine per query to
// watch it. A read transaction, on the caller's context, does start one:
// that proves the count sees them.
func TestWriterQueryStartsNoWatcher(t *testing.T) {
	db := storetest.OpenSQLite(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	count := func(run func(context.Context, func(*store.Tx) error) error) int {
		t.Helper()
		n := -1
		if err := run(ctx, func(tx *store.Tx) error {
			return tx.WithRowsOpen(ctx, "SELECT 1 UNION ALL SELECT 2", func() { n = rowWatchers() })
		}); err != nil {
			t.Fatal(err)
		}
		return n
	}
	if n := count(db.ReadTx); n < 1 {
		t.Fatalf("a read transaction's query: %d watchers, want at least 1 (the count sees none)", n)
	}
	if n := count(db.WithTx); n != 0 {
		t.Errorf("a write's query on the shared transaction: %d watchers, want 0", n)
	}
}
