package store_test

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
	"github.com/better-compute/better-compute/internal/shared/errs"
)

// R16.3: the binary knows its newest migration, and an opened database is
// at it.
func TestSchemaVersion(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		ctx := context.Background()
		known, err := store.KnownSchemaVersion(db.Dialect())
		if err != nil || known < 16 {
			t.Fatalf("KnownSchemaVersion = %d, %v; want at least 16", known, err)
		}
		got, err := db.SchemaVersion(ctx)
		if err != nil || got != known {
			t.Fatalf("SchemaVersion = %d, %v; want %d", got, err, known)
		}
	})
}

// R16.3: a snapshot of a database in use is a database at the same schema
// holding what was committed; it refuses PostgreSQL and an existing target.
func TestSnapshotSQLite(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	cfg := store.Config{Driver: "sqlite", Path: filepath.Join(dir, "bc.db")}
	db, err := store.Open(ctx, cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	_, _, pl := fixture(t, db)
	tok := insertToken(t, db, pl, 3, "", time.Hour)

	dst := filepath.Join(dir, "copy.db")
	v, err := store.SnapshotSQLite(ctx, cfg, dst)
	known, _ := store.KnownSchemaVersion(store.SQLite)
	if err != nil || v != known {
		t.Fatalf("SnapshotSQLite = %d, %v; want %d", v, err, known)
	}
	if fi, err := os.Stat(dst); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("copy: %v, %v; want mode 0600", fi, err)
	}
	if _, err := store.SnapshotSQLite(ctx, cfg, dst); err == nil {
		t.Fatal("snapshot over an existing file succeeded")
	}
	_, err = store.SnapshotSQLite(ctx, store.Config{Driver: "postgres", DSN: "postgres://x"}, filepath.Join(dir, "pg.db"))
	if !errs.Is(err, errs.InvalidState) {
		t.Fatalf("postgres snapshot: %v, want INVALID_STATE", err)
	}
	_, err = store.SnapshotSQLite(ctx, store.Config{Path: filepath.Join(dir, "missing.db")}, filepath.Join(dir, "m.db"))
	if !errs.Is(err, errs.InvalidConfig) {
		t.Fatalf("missing source: %v, want INVALID_CONFIG", err)
	}
	if _, err := os.Stat(filepath.Join(dir, "missing.db")); err == nil {
		t.Fatal("a snapshot of a missing file created it")
	}

	copyDB, err := store.Open(ctx, store.Config{Path: dst}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer copyDB.Close()
	var revoked []store.JoinToken
	if err := copyDB.WithTx(ctx, func(tx *store.Tx) (err error) { revoked, err = tx.RevokeLiveJoinTokens(ctx); return }); err != nil {
		t.Fatal(err)
	}
	if len(revoked) != 1 || revoked[0].ID != tok.ID || revoked[0].UsesLeft != 3 {
		t.Fatalf("revoked %+v, want %s with 3 uses", revoked, tok.ID)
	}
	err = copyDB.WithTx(ctx, func(tx *store.Tx) error {
		ok, err := tx.ConsumeJoinTokenUse(ctx, tok.ID)
		if ok {
			t.Error("a revoked token of the copy was spent")
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	// The source is untouched.
	err = db.ReadTx(ctx, func(tx *store.Tx) error {
		j, err := tx.GetJoinToken(ctx, tok.ID)
		if err == nil && !j.Live {
			t.Error("revoking in the copy revoked the source's token")
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
}

// R16.3: every live token of any tenant is revoked; spent, expired and
// revoked ones are left alone.
func TestRevokeLiveJoinTokens(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		ctx := context.Background()
		_, _, pl := fixture(t, db)
		_, _, other := fixture(t, db)
		a := insertToken(t, db, pl, 2, "", time.Hour)
		b := insertToken(t, db, other, 1, "", time.Hour)
		spent := insertToken(t, db, pl, 1, "", time.Hour)
		insertToken(t, db, pl, 1, "", time.Minute)
		err := db.WithTx(ctx, func(tx *store.Tx) error {
			_, err := tx.ConsumeJoinTokenUse(ctx, spent.ID)
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
		// The database's clock moves past the short token's expiry.
		if err := db.SetClockOffset(ctx, 2*time.Minute); err != nil {
			t.Fatal(err)
		}
		var got []store.JoinToken
		if err := db.WithTx(ctx, func(tx *store.Tx) (err error) { got, err = tx.RevokeLiveJoinTokens(ctx); return }); err != nil {
			t.Fatal(err)
		}
		want := map[string]bool{a.ID: true, b.ID: true}
		if len(got) != 2 || !want[got[0].ID] || !want[got[1].ID] {
			t.Fatalf("revoked %v, want %s and %s", got, a.ID, b.ID)
		}
		if err := db.WithTx(ctx, func(tx *store.Tx) (err error) { got, err = tx.RevokeLiveJoinTokens(ctx); return }); err != nil || len(got) != 0 {
			t.Fatalf("second pass revoked %v, %v; want none", got, err)
		}
	})
}
