// Package storetest opens real databases for tests (a temporary SQLite file;
// a fresh schema in the PostgreSQL named by BC_TEST_POSTGRES_DSN; a scratch
// database of the same cluster) and holds the conformance suite that every
// dialect of the store must pass. Only tests import it.
package storetest

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/shared/ids"
)

// PostgresEnv names the environment variable holding the PostgreSQL DSN for
// tests. When it is set, a database that cannot be reached fails the test;
// when it is unset, PostgreSQL tests are skipped (CI always sets it).
const PostgresEnv = "BC_TEST_POSTGRES_DSN"

// OpenSQLite opens a migrated SQLite database in a temporary directory.
func OpenSQLite(t testing.TB) *store.DB {
	t.Helper()
	db, err := store.Open(context.Background(), store.Config{Driver: "sqlite", Path: filepath.Join(t.TempDir(), "bc.db")}, nil)
	if err != nil {
		t.Fatalf("open sqlite: %v", err)
	}
	t.Cleanup(func() { db.Close() })
	return db
}

// PostgresDSN creates a fresh schema in the test PostgreSQL and returns a DSN
// whose search_path is that schema; the schema is dropped when the test ends.
// It skips the test when PostgresEnv is unset.
func PostgresDSN(t testing.TB) string {
	t.Helper()
	base := os.Getenv(PostgresEnv)
	if base == "" {
		t.Skipf("%s not set: skipping PostgreSQL", PostgresEnv)
	}
	admin, err := sql.Open("pgx", base)
	if err != nil {
		t.Fatalf("open postgres: %v", err)
	}
	defer admin.Close()
	var b [6]byte
	_, _ = rand.Read(b[:])
	schema := "bc_test_" + hex.EncodeToString(b[:])
	if _, err := admin.Exec("CREATE SCHEMA " + schema); err != nil {
		t.Fatalf("create schema in %s: %v", PostgresEnv, err)
	}
	t.Cleanup(func() {
		a, err := sql.Open("pgx", base)
		if err != nil {
			return
		}
		defer a.Close()
		_, _ = a.Exec("DROP SCHEMA " + schema + " CASCADE")
	})
	return withSearchPath(t, base, schema)
}

func withSearchPath(t testing.TB, dsn, schema string) string {
	if strings.HasPrefix(dsn, "postgres://") || strings.HasPrefix(dsn, "postgresql://") {
		u, err := url.Parse(dsn)
		if err != nil {
			t.Fatalf("parse %s: %v", PostgresEnv, err)
		}
		q := u.Query()
		q.Set("search_path", schema)
		u.RawQuery = q.Encode()
		return u.String()
	}
	return dsn + " search_path=" + schema
}

// ScratchDatabase returns a DSN for another database of the test cluster,
// bc_test_scratch, created when missing: tests use it to act as a foreign
// tenant of the cluster (e.g. hold a transaction open there). It skips the
// test when PostgresEnv is unset.
func ScratchDatabase(t testing.TB) string {
	t.Helper()
	base := os.Getenv(PostgresEnv)
	if base == "" {
		t.Skipf("%s not set: skipping PostgreSQL", PostgresEnv)
	}
	const name = "bc_test_scratch"
	admin, err := sql.Open("pgx", base)
	if err != nil {
		t.Fatalf("open postgres: %v", err)
	}
	defer admin.Close()
	var exists bool
	if err := admin.QueryRow("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)", name).Scan(&exists); err != nil {
		t.Fatalf("look for database %s: %v", name, err)
	}
	if !exists {
		// Another test process may create it at the same moment.
		if _, err := admin.Exec("CREATE DATABASE " + name); err != nil && !strings.Contains(err.Error(), "already exists") && !strings.Contains(err.Error(), "duplicate key") {
			t.Fatalf("create database %s: %v", name, err)
		}
	}
	if strings.HasPrefix(base, "postgres://") || strings.HasPrefix(base, "postgresql://") {
		u, err := url.Parse(base)
		if err != nil {
			t.Fatalf("parse %s: %v", PostgresEnv, err)
		}
		u.Path = "/" + name
		return u.String()
	}
	return base + " dbname=" + name
}

// OpenPostgres opens a migrated PostgreSQL database in a fresh schema.
func OpenPostgres(t testing.TB) *store.DB {
	t.Helper()
	dsn := PostgresDSN(t)
	db, err := store.Open(context.Background(), store.Config{Driver: "postgres", DSN: dsn}, nil)
	if err != nil {
		t.Fatalf("open postgres (%s): %v", PostgresEnv, err)
	}
	t.Cleanup(func() { db.Close() })
	return db
}

// PostgresReplicas opens n migrated stores on one fresh PostgreSQL schema,
// as n API replicas on one database would: each its own connection pool,
// sequencer and caches.
func PostgresReplicas(t testing.TB, n int) []*store.DB {
	t.Helper()
	dsn := PostgresDSN(t)
	out := make([]*store.DB, n)
	for i := range out {
		db, err := store.Open(context.Background(), store.Config{Driver: "postgres", DSN: dsn, MaxConns: 4}, nil)
		if err != nil {
			t.Fatalf("open postgres replica %d (%s): %v", i, PostgresEnv, err)
		}
		t.Cleanup(func() { db.Close() })
		out[i] = db
	}
	return out
}

// Each runs fn as a subtest on each dialect: "sqlite" and "postgres".
func Each(t *testing.T, fn func(t *testing.T, db *store.DB)) {
	t.Helper()
	t.Run("sqlite", func(t *testing.T) { fn(t, OpenSQLite(t)) })
	t.Run("postgres", func(t *testing.T) { fn(t, OpenPostgres(t)) })
}

// Node inserts a tenant, a site, a bcd pool and one node of that pool in
// state, generation 1, and returns the node: the smallest fleet a
// controller or command test needs.
func Node(t testing.TB, db *store.DB, state string) store.Node {
	t.Helper()
	ctx := context.Background()
	now := time.Now()
	var n store.Node
	err := db.WithTx(ctx, func(tx *store.Tx) error {
		tn, err := tx.InsertTenant(ctx, ids.New(ids.Tenant, now), "acme-"+ids.New("x", now))
		if err != nil {
			return err
		}
		st, err := tx.InsertSite(ctx, store.Site{ID: ids.New(ids.Site, now), OwnerTenantID: tn.ID, Name: "eu-1", Region: "eu"})
		if err != nil {
			return err
		}
		pl, err := tx.InsertPool(ctx, store.Pool{ID: ids.New(ids.Pool, now), SiteID: st.ID, OwnerTenantID: tn.ID, Name: "gpu", Agent: "bcd", Policy: []byte(`{}`)})
		if err != nil {
			return err
		}
		n, err = tx.InsertNode(ctx, store.Node{ID: ids.New(ids.Node, now), TenantID: tn.ID, SiteID: st.ID, PoolID: pl.ID, Role: "node",
			State: state, IdentityGeneration: 1, NodeKey: "unattested", Attestor: "join-token", Claims: []byte(`{}`)})
		return err
	})
	if err != nil {
		t.Fatalf("store a node: %v", err)
	}
	return n
}

// PostgresWithRaw opens a migrated PostgreSQL store in a fresh schema and a
// plain connection pool to the same schema, for tests that act behind the
// store's back (hold locks, write as an older replica would).
func PostgresWithRaw(t testing.TB) (*store.DB, *sql.DB) {
	t.Helper()
	dsn := PostgresDSN(t)
	db, err := store.Open(context.Background(), store.Config{Driver: "postgres", DSN: dsn, MaxConns: 4}, nil)
	if err != nil {
		t.Fatalf("open postgres (%s): %v", PostgresEnv, err)
	}
	t.Cleanup(func() { db.Close() })
	raw, err := sql.Open("pgx", dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { raw.Close() })
	return db, raw
}
