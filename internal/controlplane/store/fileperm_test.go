package store_test

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/better-compute/better-compute/internal/controlplane/store"
)

// R1.2 (credentials hashed at rest, and the hashes kept private): the
// SQLite database (key and token hashes, the audit trail) and its WAL and
// SHM files are owner-only, whether Open creates the file (`better-compute
// dev`, serve) or finds one an older version left 0644.
func TestSQLiteFilesOwnerOnly(t *testing.T) {
	for _, tc := range []struct {
		name     string
		existing bool // a database file (and -wal, -shm) made 0644 before Open
	}{
		{"created by Open", false},
		{"left 0644 before", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "bc.db")
			if tc.existing {
				for _, p := range []string{path, path + "-wal", path + "-shm"} {
					if err := os.WriteFile(p, nil, 0o644); err != nil {
						t.Fatal(err)
					}
					if err := os.Chmod(p, 0o644); err != nil {
						t.Fatal(err)
					}
				}
			}
			db, err := store.Open(context.Background(), store.Config{Driver: "sqlite", Path: path}, nil)
			if err != nil {
				t.Fatalf("Open: %v", err)
			}
			defer db.Close()
			// A write makes sure the WAL and SHM files exist.
			if err := db.WithTx(context.Background(), func(tx *store.Tx) error { return tx.SetRootTenantID(context.Background(), "") }); err != nil {
				t.Fatalf("write: %v", err)
			}
			for _, p := range []string{path, path + "-wal", path + "-shm"} {
				fi, err := os.Stat(p)
				if err != nil {
					t.Fatalf("stat %s: %v", filepath.Base(p), err)
				}
				if m := fi.Mode().Perm(); m != 0o600 {
					t.Errorf("%s has mode %#o, want 0600", filepath.Base(p), m)
				}
			}
		})
	}
}
