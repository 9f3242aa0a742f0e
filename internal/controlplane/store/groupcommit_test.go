package store_test

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"modernc.org/sqlite"

	"github.com/better-compute/better-compute/internal/checks/poll"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
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
	poll.UntilDetail(t, 10*time.Second, func() string { return fmt.Sprintf("%d writes queued (now %d)", n, db.QueuedWrites()) },
		func() bool { return db.QueuedWrites() >= n })
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

// participant is one write transaction of a batch.
type participant struct {
	ctx context.Context
	fn  func(*store.Tx) error
}

// batchOf runs ps as one SQLite group commit, in order, and returns each
// one's outcome: the first holds the writer until all the others wait
// behind it, and the writer takes those waiting into its batch.
func batchOf(t *testing.T, db *store.DB, ps ...participant) []error {
	t.Helper()
	return batchThen(t, db, func() {}, ps...)
}

// batchThen is batchOf calling queued once all of ps wait in the batch,
// before they run.
func batchThen(t *testing.T, db *store.DB, queued func(), ps ...participant) []error {
	t.Helper()
	out := make([]chan error, len(ps))
	for i := range out {
		out[i] = make(chan error, 1)
	}
	in, hold := make(chan struct{}), make(chan struct{})
	var once sync.Once
	release := func() { once.Do(func() { close(hold) }) }
	defer release() // also when the test fails here: the writer must go on
	go func() {
		first := ps[0]
		var entered sync.Once
		out[0] <- db.WithTx(first.ctx, func(tx *store.Tx) error {
			err := first.fn(tx)
			// fn may run again (alone, after a failed shared commit).
			entered.Do(func() { close(in) })
			<-hold
			return err
		})
	}()
	<-in
	for i, p := range ps[1:] {
		go func() { out[i+1] <- db.WithTx(p.ctx, p.fn) }()
		waitQueued(t, db, i+1)
	}
	queued()
	release()
	errs := make([]error, len(ps))
	for i, c := range out {
		select {
		case errs[i] = <-c:
		case <-time.After(30 * time.Second):
			t.Fatalf("participant %d never answered", i)
		}
	}
	return errs
}

// R14.1: one participant that fails, panics or leaves its goroutine (a
// test's t.Fatal) after writing, or whose statement fails in the driver
// (a constraint, or SQL that does not prepare, on the writer's driver
// connection), is rolled back alone and told its error; the participants
// before and after it in the same commit are committed and told so, and
// the writer goes on.
func TestGroupCommitParticipantFails(t *testing.T) {
	boom := errors.New("boom")
	ctx := context.Background()
	exec := func(q string) func(*store.Tx) error { return func(tx *store.Tx) error { return tx.ExecRaw(ctx, q) } }
	queryRow := func(q string) func(*store.Tx) error {
		return func(tx *store.Tx) error { _, err := tx.QueryInt(ctx, q); return err }
	}
	for _, tc := range []struct {
		name string
		fail func(*store.Tx) error
		want string
	}{
		{"error", func(*store.Tx) error { return boom }, "boom"},
		{"panic", func(*store.Tx) error { panic("participant panics") }, "panic in transaction: participant panics"},
		{"goexit", func(*store.Tx) error { runtime.Goexit(); return nil }, "transaction function exited without returning"},
		{"statement, constraint", exec("INSERT INTO gc_rows (who, n) VALUES ('X', NULL)"), "NOT NULL constraint failed"},
		{"one-row query, constraint", queryRow("INSERT INTO gc_rows (who, n) VALUES ('X', NULL) RETURNING n"), "NOT NULL constraint failed"},
		{"statement, does not prepare", exec("INSERT INTO gc_nowhere (who) VALUES ('X')"), "no such table"},
		{"one-row query, does not prepare", queryRow("SELEC 1"), "syntax error"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			db := storetest.OpenSQLite(t)
			ctx := context.Background()
			scratch(t, db, "CREATE TABLE gc_rows (who TEXT NOT NULL, n INTEGER NOT NULL)")
			errs := batchOf(t, db,
				participant{ctx, insertRow("B")},
				participant{ctx, func(tx *store.Tx) error {
					if err := insertRow("X")(tx); err != nil {
						return err
					}
					return tc.fail(tx)
				}},
				participant{ctx, insertRow("C")})
			wantAloneFailed(t, db, errs, tc.want)
			if err := db.WithTx(ctx, insertRow("D")); err != nil || rowsOf(t, db, "D") != 1 {
				t.Fatalf("write after the batch: %v", err)
			}
		})
	}
}

// wantAloneFailed checks the outcomes of a batch of B, X and C in which X
// alone failed, with an error containing want: B and C committed, and
// nothing of X did.
func wantAloneFailed(t *testing.T, db *store.DB, errs []error, want string) {
	t.Helper()
	if errs[0] != nil || errs[2] != nil {
		t.Errorf("B, C: %v, %v; want both committed", errs[0], errs[2])
	}
	if errs[1] == nil || !strings.Contains(errs[1].Error(), want) {
		t.Errorf("X: err = %v, want %q", errs[1], want)
	}
	for who, n := range map[string]int64{"B": 1, "X": 0, "C": 1} {
		if got := rowsOf(t, db, who); got != n {
			t.Errorf("rows of %s = %d, want %d", who, got, n)
		}
	}
}

// A participant whose context ends while it waits in the batch never runs;
// the others commit.
func TestGroupCommitCancelledWhileQueued(t *testing.T) {
	db := storetest.OpenSQLite(t)
	ctx := context.Background()
	scratch(t, db, "CREATE TABLE gc_rows (who TEXT NOT NULL, n INTEGER NOT NULL)")
	xctx, cancel := context.WithCancel(ctx)
	ran := false
	errs := batchThen(t, db, cancel,
		participant{ctx, insertRow("B")},
		participant{xctx, func(tx *store.Tx) error { ran = true; return insertRow("X")(tx) }},
		participant{ctx, insertRow("C")})
	if errs[0] != nil || errs[2] != nil || !errors.Is(errs[1], context.Canceled) || ran {
		t.Fatalf("outcomes %v (X ran: %v); want nil, context.Canceled without running, nil", errs, ran)
	}
	for who, want := range map[string]int64{"B": 1, "X": 0, "C": 1} {
		if got := rowsOf(t, db, who); got != want {
			t.Errorf("rows of %s = %d, want %d", who, got, want)
		}
	}
}

// deferredFK makes gc_child, whose parent is checked only at COMMIT: a
// participant that inserts an orphan child makes the shared COMMIT fail.
var deferredFK = []string{
	"CREATE TABLE gc_rows (who TEXT NOT NULL, n INTEGER NOT NULL)",
	"CREATE TABLE gc_parent (id INTEGER PRIMARY KEY)",
	"CREATE TABLE gc_child (id INTEGER PRIMARY KEY, parent INTEGER NOT NULL REFERENCES gc_parent (id) DEFERRABLE INITIALLY DEFERRED)",
}

func orphan(tx *store.Tx) error {
	if err := insertRow("X")(tx); err != nil {
		return err
	}
	return tx.ExecRaw(context.Background(), "INSERT INTO gc_child (id, parent) VALUES (1, 42)")
}

// R14.1: when the shared COMMIT fails (here a deferred foreign key one
// participant violated), nothing of the batch is committed and each
// participant runs again alone: the guilty one is told its COMMIT failed,
// the others commit. Then the writer goes on.
func TestGroupCommitCommitFails(t *testing.T) {
	db := storetest.OpenSQLite(t)
	ctx := context.Background()
	scratch(t, db, deferredFK...)
	errs := batchOf(t, db,
		participant{ctx, insertRow("B")},
		participant{ctx, orphan},
		participant{ctx, insertRow("C")})
	if errs[0] != nil || errs[2] != nil {
		t.Errorf("B, C: %v, %v; want both committed", errs[0], errs[2])
	}
	if errs[1] == nil || !strings.Contains(errs[1].Error(), "FOREIGN KEY") || errors.Is(errs[1], store.ErrCommitUnknown) {
		t.Errorf("X: err = %v, want its failed COMMIT (a foreign key), known", errs[1])
	}
	for who, want := range map[string]int64{"B": 1, "X": 0, "C": 1} {
		if got := rowsOf(t, db, who); got != want {
			t.Errorf("rows of %s = %d, want %d", who, got, want)
		}
	}
	if err := db.WithTx(ctx, insertRow("D")); err != nil || rowsOf(t, db, "D") != 1 {
		t.Fatalf("write after the failed commit: %v", err)
	}
}

// A BEGIN that fails (another process holds SQLite's write lock longer than
// the busy timeout) fails the transaction that waited for it, with nothing
// written; the writer goes on once the lock is free.
func TestGroupCommitBeginFails(t *testing.T) {
	path := filepath.Join(t.TempDir(), "bc.db")
	ctx := context.Background()
	db, err := store.Open(ctx, store.WithBusyTimeout(store.Config{Driver: "sqlite", Path: path}, 100*time.Millisecond), nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	scratch(t, db, "CREATE TABLE gc_rows (who TEXT NOT NULL, n INTEGER NOT NULL)")

	other, err := sql.Open("sqlite", "file:"+path)
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	lock, err := other.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer lock.Close()
	if _, err := lock.ExecContext(ctx, "BEGIN IMMEDIATE"); err != nil {
		t.Fatal(err)
	}
	ran := false
	err = db.WithTx(ctx, func(tx *store.Tx) error { ran = true; return insertRow("X")(tx) })
	if err == nil || !strings.Contains(err.Error(), "begin transaction") || ran {
		t.Fatalf("write while another process holds the lock: err = %v, ran = %v; want a begin failure, not run", err, ran)
	}
	if _, err := lock.ExecContext(ctx, "ROLLBACK"); err != nil {
		t.Fatal(err)
	}
	if err := db.WithTx(ctx, insertRow("D")); err != nil {
		t.Fatalf("write after the lock was released: %v", err)
	}
	for who, want := range map[string]int64{"X": 0, "D": 1} {
		if got := rowsOf(t, db, who); got != want {
			t.Errorf("rows of %s = %d, want %d", who, got, want)
		}
	}
}
