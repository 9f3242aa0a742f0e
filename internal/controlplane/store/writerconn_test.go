package store_test

import (
	"context"
	"errors"
	"runtime"
	"strings"
	"testing"

	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
)

// rowWatchers returns the ids of the goroutines database/sql started to
// watch a query's context (Rows.initContextClose), run or not yet.
func rowWatchers() map[string]bool {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			buf = buf[:n]
			break
		}
		buf = make([]byte, 2*len(buf))
	}
	ids := map[string]bool{}
	for _, g := range strings.Split(string(buf), "\n\n") {
		if id, _, ok := strings.Cut(strings.TrimPrefix(g, "goroutine "), " "); ok && strings.Contains(g, "created by database/sql.(*Rows).initContextClose") {
			ids[id] = true
		}
	}
	return ids
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
		// Watchers of earlier queries may not have exited yet: count the
		// ones that were not there before this query.
		n := -1
		if err := run(ctx, func(tx *store.Tx) error {
			before := rowWatchers()
			return tx.WithRowsOpen(ctx, "SELECT 1 UNION ALL SELECT 2", func() {
				n = 0
				for id := range rowWatchers() {
					if !before[id] {
						n++
					}
				}
			})
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

// blockingCount counts 100000 rows, stopping at its first until the test
// releases it (test_block).
const blockingCount = `SELECT COUNT(*) FROM (WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 100000) SELECT x FROM c)
	WHERE test_block(x) = 1`

// R14.1, R4.9: a participant whose context is cancelled while one of its
// statements runs (here a one-row query, which the writer runs on the
// driver connection) sees the statement run to its end; what it does next
// decides its outcome, and it is told exactly that: carrying on with
// another statement fails it alone (rolled back to its savepoint),
// returning nil commits it with the others.
func TestGroupCommitCancelMidQueryRow(t *testing.T) {
	for _, tc := range []struct {
		name    string
		next    func(ctx context.Context, tx *store.Tx) error
		wantErr error
		rows    int64
	}{
		{"another statement", func(ctx context.Context, tx *store.Tx) error {
			return tx.ExecRaw(ctx, "INSERT INTO gc_rows (who, n) VALUES ('A', 2)")
		}, context.Canceled, 0},
		{"returns", func(context.Context, *store.Tx) error { return nil }, nil, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			db := storetest.OpenSQLite(t)
			ctx := context.Background()
			scratch(t, db, "CREATE TABLE gc_rows (who TEXT NOT NULL, n INTEGER NOT NULL)")
			entered, release := armBlock(t)
			actx, cancelA := context.WithCancel(ctx)
			defer cancelA()
			go func() {
				<-entered
				cancelA()
				close(release)
			}()
			var counted int64
			errs := batchOf(t, db,
				participant{ctx, insertRow("B")},
				participant{actx, func(tx *store.Tx) error {
					if err := tx.ExecRaw(actx, "INSERT INTO gc_rows (who, n) VALUES ('A', 1)"); err != nil {
						return err
					}
					var err error
					if counted, err = tx.QueryInt(actx, blockingCount); err != nil {
						return err
					}
					return tc.next(actx, tx)
				}},
				participant{ctx, insertRow("C")})
			if counted != 100000 {
				t.Errorf("A's query counted %d rows, want 100000: it was interrupted", counted)
			}
			if errs[0] != nil || errs[2] != nil {
				t.Errorf("B, C: %v, %v; want both committed", errs[0], errs[2])
			}
			if !errors.Is(errs[1], tc.wantErr) || (tc.wantErr == nil) != (errs[1] == nil) {
				t.Errorf("A: err = %v, want %v", errs[1], tc.wantErr)
			}
			for who, want := range map[string]int64{"B": 1, "A": tc.rows, "C": 1} {
				if got := rowsOf(t, db, who); got != want {
					t.Errorf("rows of %s = %d, want %d", who, got, want)
				}
			}
		})
	}
}
