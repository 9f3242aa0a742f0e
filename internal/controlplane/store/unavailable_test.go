package store_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
	"github.com/better-compute/better-compute/internal/shared/errs"
)

// wantUnavailable checks err is UNAVAILABLE naming reason, with the
// driver's error kept as its cause and out of the message.
func wantUnavailable(t *testing.T, err error, reason string) {
	t.Helper()
	e, ok := errs.As(err)
	if !ok || e.Code != errs.Unavailable || e.Message != "the database is "+reason+"; retry shortly" {
		t.Fatalf("got %v, want UNAVAILABLE: the database is %s", err, reason)
	}
	if errors.Unwrap(e) == nil || store.UnavailableReason(errors.Unwrap(e)) != reason {
		t.Fatalf("the cause is lost: %v", errors.Unwrap(e))
	}
}

// R19.1: a database that is out of space answers UNAVAILABLE, never an
// internal error, and takes writes again once there is room.
func TestFullDatabaseIsUnavailableR19_1(t *testing.T) {
	// No outage wait: a retry may land on a new writer connection, which
	// has room again (max_page_count is the connection's).
	db := openSQLiteWait(t, -time.Second)
	ctx := context.Background()
	err := db.WithTx(ctx, func(tx *store.Tx) error {
		if err := tx.ExecRaw(ctx, "CREATE TABLE filler (b BLOB)"); err != nil {
			return err
		}
		n, err := tx.QueryInt(ctx, "PRAGMA page_count")
		if err != nil {
			return err
		}
		// The writer's connection may grow no further: the next pages
		// are a full disk.
		if _, err := tx.QueryInt(ctx, fmt.Sprintf("PRAGMA max_page_count = %d", n+1)); err != nil {
			return err
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	err = db.WithTx(ctx, func(tx *store.Tx) error {
		return tx.ExecRaw(ctx, "INSERT INTO filler (b) VALUES (zeroblob(1048576))")
	})
	wantUnavailable(t, err, store.UnavailableFull)
	if err := db.WithTx(ctx, func(tx *store.Tx) error {
		if _, err := tx.QueryInt(ctx, "PRAGMA max_page_count = 1073741823"); err != nil {
			return err
		}
		return tx.ExecRaw(ctx, "INSERT INTO filler (b) VALUES (zeroblob(1024))")
	}); err != nil {
		t.Fatalf("with room again: %v", err)
	}
}

// R19.1: on PostgreSQL a read-only database and a connection the server
// ended (a restart, a failover) answer UNAVAILABLE; the next transaction
// gets a new connection and works.
func TestPostgresFaultsAreUnavailableR19_1(t *testing.T) {
	db := storetest.OpenPostgres(t)
	ctx := context.Background()
	err := db.WithTx(ctx, func(tx *store.Tx) error {
		if err := tx.ExecRaw(ctx, "SET TRANSACTION READ ONLY"); err != nil {
			return err
		}
		return tx.ExecRaw(ctx, "UPDATE compute_clock SET offset_ms = offset_ms WHERE id = 1")
	})
	wantUnavailable(t, err, store.UnavailableReadOnly)
	err = db.WithTx(ctx, func(tx *store.Tx) error {
		_, err := tx.QueryInt(ctx, "SELECT 1 FROM (SELECT pg_terminate_backend(pg_backend_pid())) AS x")
		return err
	})
	wantUnavailable(t, err, store.UnavailableUnreachable)
	if err := db.WithTx(ctx, func(tx *store.Tx) error {
		_, err := tx.QueryInt(ctx, "SELECT 1")
		return err
	}); err != nil {
		t.Fatalf("after the connection ended: %v", err)
	}
}

// R19.1: product errors and constraint violations pass through as they
// are; only the database's own failures become UNAVAILABLE.
func TestUnavailableReason(t *testing.T) {
	for _, tc := range []struct {
		name string
		err  error
		want string
	}{
		{"nil", nil, ""},
		{"a product error", errs.New(errs.NotFound, "x"), ""},
		{"a plain error", errors.New("boom"), ""},
		{"not found", store.ErrNotFound, ""},
		// pgx's error for a pooled connection closed under it (found by
		// e2e: BEGIN after PostgreSQL dropped its connections).
		{"a closed connection", fmt.Errorf("begin transaction: %w", pgconn.ErrConnClosed), store.UnavailableUnreachable},
	} {
		if got := store.UnavailableReason(tc.err); got != tc.want {
			t.Errorf("%s: %q, want %q", tc.name, got, tc.want)
		}
	}
}
