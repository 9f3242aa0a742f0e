package store_test

import (
	"context"
	"errors"
	"reflect"
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

// R14.1, R11.3: the writer's multi-row queries read straight from the
// driver (rawRows) and scan exactly as database/sql does in a read
// transaction: the same nodes (NULL and set columns, blobs, timestamps, a
// node made ahead and joined ones), events and audit rows, in the same
// order; a query that fails to run is that query's error.
func TestWriterRowsScanAsDatabaseSQL(t *testing.T) {
	db := storetest.OpenSQLite(t)
	ctx := context.Background()
	tn, _, pl := fixture(t, db)
	if err := db.WithTx(ctx, func(tx *store.Tx) error {
		if _, err := tx.InsertNode(ctx, pendingNode(pl, "made-ahead", "deploy-1")); err != nil {
			return err
		}
		for i := range 3 {
			n, _ := insertNodeWithCert(t, tx, pl, i, "")
			if err := tx.InsertEvent(ctx, tn.ID, "node.joined", n.ID, []byte(`{"n":1}`)); err != nil {
				return err
			}
			if err := tx.InsertAudit(ctx, store.AuditEntry{TenantID: tn.ID, Actor: "node:" + n.ID, Action: "node.joined", Resource: "compute-node/" + n.ID, Data: []byte(`{}`)}); err != nil {
				return err
			}
		}
		_, err := tx.ConnectNode(ctx, mustFirstNode(t, tx, tn.ID).ID, "sess-1")
		return err
	}); err != nil {
		t.Fatal(err)
	}
	type read struct {
		Nodes []store.Node
		Certs []store.NodeCert
		Evs   []store.Event
		Audit []store.AuditEntry
	}
	readAll := func(run func(context.Context, func(*store.Tx) error) error) read {
		t.Helper()
		var r read
		if err := run(ctx, func(tx *store.Tx) error {
			var err error
			if r.Nodes, err = tx.ListNodes(ctx, tn.ID, "", "", 100); err != nil {
				return err
			}
			for _, n := range r.Nodes {
				certs, err := tx.ListNodeCerts(ctx, n.ID, 10)
				if err != nil {
					return err
				}
				r.Certs = append(r.Certs, certs...)
			}
			if r.Evs, err = tx.ListEvents(ctx, tn.ID, 0, 0, "", 100); err != nil {
				return err
			}
			r.Audit, err = tx.ListAudit(ctx, tn.ID, 0, 100)
			return err
		}); err != nil {
			t.Fatal(err)
		}
		return r
	}
	want, got := readAll(db.ReadTx), readAll(db.WithTx)
	if len(want.Nodes) != 4 || len(want.Certs) != 3 || len(want.Evs) != 3 || len(want.Audit) != 3 {
		t.Fatalf("read %d nodes, %d certificates, %d events, %d audit rows; want 4, 3, 3, 3", len(want.Nodes), len(want.Certs), len(want.Evs), len(want.Audit))
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("the writer's rows differ from database/sql's:\n got %+v\nwant %+v", got, want)
	}
	if err := db.WithTx(ctx, func(tx *store.Tx) error {
		_, err := tx.QueryTexts(ctx, "SELECT no_such_column FROM nodes")
		return err
	}); err == nil || !strings.Contains(err.Error(), "no_such_column") {
		t.Fatalf("a query that cannot run: %v, want its error", err)
	}
}

// mustFirstNode is the tenant's first node by id.
func mustFirstNode(t *testing.T, tx *store.Tx, tenantID string) store.Node {
	t.Helper()
	nodes, err := tx.ListNodes(context.Background(), tenantID, "", "", 1)
	if err != nil || len(nodes) != 1 {
		t.Fatalf("first node: %v (%d)", err, len(nodes))
	}
	return nodes[0]
}
