package store_test

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/better-compute/better-compute/internal/checks/poll"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
	"github.com/better-compute/better-compute/internal/shared/errs"
)

// openSQLiteWait opens a SQLite store whose writes wait wait for an outage.
func openSQLiteWait(t *testing.T, wait time.Duration) *store.DB {
	t.Helper()
	db, err := store.Open(context.Background(), store.Config{Path: filepath.Join(t.TempDir(), "bc.db"), OutageWait: wait}, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	return db
}

// restarting is the error PostgreSQL answers while it shuts down.
var restarting = &pgconn.PgError{Code: "57P01", Message: "terminating connection due to administrator command"}

// R19.1: a write transaction that meets an outage (the database down,
// read-only or full) runs again until the database takes it, for up to
// OutageWait; one whose outcome is unknown, or that was refused, never
// runs again here.
func TestWriteWaitsForTheStoreR19_1(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		for _, c := range []struct {
			name      string
			fail      func(call int) error // the error of fn's call-th run
			wantCalls int
			wantErr   error
		}{
			{"the database back after three failures", func(n int) error {
				if n <= 3 {
					return fmt.Errorf("insert: %w", restarting)
				}
				return nil
			}, 4, nil},
			{"out of space, then room", func(n int) error {
				if n == 1 {
					return &pgconn.PgError{Code: "53100", Message: "could not extend file"}
				}
				return nil
			}, 2, nil},
			{"a commit of unknown outcome is not run again", func(int) error { return fmt.Errorf("commit: %w", store.ErrCommitUnknown) }, 1, store.ErrCommitUnknown},
			{"a refusal is not run again", func(int) error { return errs.New(errs.AccessDenied, "Join refused") }, 1, nil},
		} {
			t.Run(c.name, func(t *testing.T) {
				calls := 0
				err := db.WithTx(context.Background(), func(tx *store.Tx) error {
					calls++
					return c.fail(calls)
				})
				if calls != c.wantCalls {
					t.Errorf("fn ran %d times, want %d (err %v)", calls, c.wantCalls, err)
				}
				switch {
				case c.wantErr != nil && !errors.Is(err, c.wantErr):
					t.Errorf("err %v, want %v", err, c.wantErr)
				case c.wantErr == nil && c.wantCalls > 1 && err != nil:
					t.Errorf("err %v, want success once the database is back", err)
				}
			})
		}
	})
	t.Run("bounded", func(t *testing.T) {
		db := openSQLiteWait(t, 300*time.Millisecond)
		calls := 0
		start := time.Now()
		err := db.WithTx(context.Background(), func(*store.Tx) error { calls++; return restarting })
		if e, ok := errs.As(err); !ok || e.Code != errs.Unavailable || e.Message != "the database is unreachable; retry shortly" {
			t.Fatalf("err %v, want UNAVAILABLE: the database is unreachable", err)
		}
		if calls < 2 || time.Since(start) < 300*time.Millisecond {
			t.Errorf("%d runs in %s: want it waited out its 300 ms", calls, time.Since(start))
		}
	})
	t.Run("no wait", func(t *testing.T) {
		db := openSQLiteWait(t, -time.Second)
		calls := 0
		_ = db.WithTx(context.Background(), func(*store.Tx) error { calls++; return restarting })
		if calls != 1 {
			t.Errorf("fn ran %d times with outage_wait -1s, want once", calls)
		}
	})
}

// refuseWrites makes the database refuse writes as read-only (on) or take
// them again: SQLite's writer connection turns query-only; on PostgreSQL
// a trigger refuses the readiness row with read_only_sql_transaction, as a
// standby or a read-only database does.
func refuseWrites(t *testing.T, db *store.DB, on bool) {
	t.Helper()
	ctx := context.Background()
	q := map[bool]string{true: "PRAGMA query_only = ON", false: "PRAGMA query_only = OFF"}[on]
	if db.Dialect() == store.Postgres {
		q = "DROP TRIGGER refuse ON ready_probe"
		if on {
			q = `CREATE FUNCTION refuse_probe() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RAISE EXCEPTION 'read-only' USING ERRCODE = '25006'; END $$;
CREATE TRIGGER refuse BEFORE INSERT OR UPDATE ON ready_probe FOR EACH ROW EXECUTE FUNCTION refuse_probe()`
		}
	}
	if err := db.WithTx(ctx, func(tx *store.Tx) error { return tx.ExecRaw(ctx, q) }); err != nil {
		t.Fatal(err)
	}
}

// R19.1: readiness fails while the database refuses writes, though it
// still answers reads, names the reason, and recovers by itself.
func TestCheckWritesR19_1(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		ctx := context.Background()
		if err := db.CheckWrites(ctx); err != nil {
			t.Fatalf("a healthy database: %v", err)
		}
		refuseWrites(t, db, true)
		var last error
		poll.UntilDetail(t, 10*time.Second, func() string { return fmt.Sprintf("the write check to fail read-only; last %v", last) }, func() bool {
			last = db.CheckWrites(ctx)
			return store.UnavailableReason(last) == store.UnavailableReadOnly
		})
		if e, ok := errs.As(last); !ok || e.Code != errs.Unavailable {
			t.Errorf("%v, want UNAVAILABLE", last)
		}
		if err := db.Ping(ctx); err != nil {
			t.Fatalf("reads fail too: %v", err)
		}
		refuseWrites(t, db, false)
		poll.Until(t, 10*time.Second, "the write check to pass again", func() bool { return db.CheckWrites(ctx) == nil })
	})
}

// R19.1: a write that failed for an outage fails readiness at once, even
// when the probe's one row still fits (a full disk's write-ahead log may
// reuse its space), until a write commits again.
func TestCheckWritesAfterFailedWriteR19_1(t *testing.T) {
	db := openSQLiteWait(t, -time.Second)
	ctx := context.Background()
	if err := db.CheckWrites(ctx); err != nil {
		t.Fatal(err)
	}
	full := &pgconn.PgError{Code: "53100", Message: "could not extend file"}
	_ = db.WithTx(ctx, func(*store.Tx) error { return full })
	if err := db.CheckWrites(ctx); store.UnavailableReason(err) != store.UnavailableFull {
		t.Fatalf("after a write failed for space: %v, want out of space", err)
	}
	if err := db.WithTx(ctx, func(*store.Tx) error { return nil }); err != nil {
		t.Fatal(err)
	}
	if err := db.CheckWrites(ctx); err != nil {
		t.Fatalf("after a write committed: %v", err)
	}
}
