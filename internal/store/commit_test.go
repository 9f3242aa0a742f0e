package store_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/store"
	"github.com/better-compute/better-compute/internal/store/storetest"
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
	deadline := time.Now().Add(10 * time.Second)
	for rowsOf(t, db, who) != want {
		if time.Now().After(deadline) {
			t.Fatalf("rows of %s = %d, want %d", who, rowsOf(t, db, who), want)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// R4.9: a commit that lands after the caller's deadline is reported as
// landed. Before the fix, COMMIT ran on the caller's context and the driver
// gave up on it at the deadline: "context deadline exceeded" for a
// transaction that committed.
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
