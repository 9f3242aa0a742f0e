package store_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/checks/poll"
	"github.com/better-compute/better-compute/internal/shared/errs"

	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
)

// slowCommitTables makes gc_rows, whose rows with n = 1 make COMMIT take
// `sleep` (a deferred constraint trigger runs inside COMMIT).
func slowCommitTables(t *testing.T, db *store.DB, sleep time.Duration) {
	t.Helper()
	scratch(t, db,
		"CREATE TABLE gc_rows (who TEXT NOT NULL, n INTEGER NOT NULL)",
		`CREATE FUNCTION gc_slow_commit() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN PERFORM pg_sleep(`+fmt.Sprintf("%.3f", sleep.Seconds())+`); RETURN NULL; END $$`,
		`CREATE CONSTRAINT TRIGGER gc_slow AFTER INSERT ON gc_rows DEFERRABLE INITIALLY DEFERRED
		FOR EACH ROW WHEN (NEW.n = 1) EXECUTE FUNCTION gc_slow_commit()`)
}

// waitRows polls until who has want rows.
func waitRows(t *testing.T, db *store.DB, who string, want int64) {
	t.Helper()
	poll.UntilDetail(t, 10*time.Second, func() string { return fmt.Sprintf("rows of %s = %d, want %d", who, rowsOf(t, db, who), want) },
		func() bool { return rowsOf(t, db, who) == want })
}

// R4.9: a commit that lands after the caller's deadline is reported as
// landed. Before the fix, COMMIT ran on the caller's context: at the
// deadline the driver stopped reading and cancelled it, and the caller got
// "context deadline exceeded" (this test failed so); in the field the
// cancel raced with a COMMIT that had already landed, so committed joins
// were reported as failed.
func TestCommitOutlivesCallerDeadline(t *testing.T) {
	db := storetest.OpenPostgres(t)
	slowCommitTables(t, db, 500*time.Millisecond)
	ctx, cancel := context.WithTimeout(context.Background(), 150*time.Millisecond)
	defer cancel()
	err := db.WithTx(ctx, func(tx *store.Tx) error {
		return tx.ExecRaw(ctx, "INSERT INTO gc_rows (who, n) VALUES ('slow', 1)")
	})
	if ctx.Err() == nil {
		t.Fatal("the commit did not outlast the caller's deadline; the test proves nothing")
	}
	if err != nil {
		t.Errorf("err = %v, want nil: the commit landed", err)
	}
	waitRows(t, db, "slow", 1)
}

// R4.9: a COMMIT given up on (no answer within the commit bound) is
// reported as unknown, with UNAVAILABLE, and never retried (it may have
// landed).
func TestCommitUnknown(t *testing.T) {
	db := storetest.OpenPostgres(t)
	slowCommitTables(t, db, 2*time.Second)
	db.SetCommitTimeout(200 * time.Millisecond)
	ctx := context.Background()
	runs := 0
	err := db.WithTx(ctx, func(tx *store.Tx) error {
		runs++
		return tx.ExecRaw(ctx, "INSERT INTO gc_rows (who, n) VALUES ('slow', 1)")
	})
	if !errors.Is(err, store.ErrCommitUnknown) || errs.CodeOf(err) != errs.Unavailable || runs != 1 {
		t.Fatalf("err = %v (code %s), runs = %d; want ErrCommitUnknown, UNAVAILABLE, one run", err, errs.CodeOf(err), runs)
	}
	db.SetCommitTimeout(15 * time.Second)
	if err := db.WithTx(ctx, insertRow("after")); err != nil {
		t.Fatalf("write after an unknown commit: %v", err)
	}
}

// R14.1: a COMMIT the database refuses (a deferred foreign key) is a known
// rollback, never ErrCommitUnknown, and nothing of it is written.
func TestCommitRefusedIsKnown(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		ctx := context.Background()
		scratch(t, db, deferredFK...)
		err := db.WithTx(ctx, orphan)
		if err == nil || errors.Is(err, store.ErrCommitUnknown) || !strings.Contains(strings.ToLower(err.Error()), "foreign key") {
			t.Fatalf("err = %v, want a known foreign key failure", err)
		}
		if n := rowsOf(t, db, "X"); n != 0 {
			t.Fatalf("rows of a refused commit: %d", n)
		}
	})
}

// The caller's context interrupts a statement that runs: the transaction
// fails with nothing written, and the next transactions run normally.
func TestStatementInterruptedRollsBack(t *testing.T) {
	db := storetest.OpenPostgres(t)
	scratch(t, db, "CREATE TABLE gc_rows (who TEXT NOT NULL, n INTEGER NOT NULL)")
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	err := db.WithTx(ctx, func(tx *store.Tx) error {
		if err := tx.ExecRaw(ctx, "INSERT INTO gc_rows (who, n) VALUES ('X', 0)"); err != nil {
			return err
		}
		return tx.ExecRaw(ctx, "SELECT pg_sleep(5)")
	})
	if err == nil || errors.Is(err, store.ErrCommitUnknown) {
		t.Fatalf("err = %v, want the interrupted statement's error", err)
	}
	if err := db.WithTx(context.Background(), insertRow("D")); err != nil {
		t.Fatal(err)
	}
	for who, want := range map[string]int64{"X": 0, "D": 1} {
		if got := rowsOf(t, db, who); got != want {
			t.Errorf("rows of %s = %d, want %d", who, got, want)
		}
	}
}
